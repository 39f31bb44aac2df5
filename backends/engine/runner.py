"""The model runner: owns the torch model and one KV cache per sequence.

Invariant (DESIGN.md property 4): after every round, a sequence's cache holds exactly the committed
prefix minus the last committed token, which the next step feeds: ``cache_len == committed_len - 1``.
A round feeds ``[last_committed, d_1..d_k]`` (k + 1 positions), then ``rollback`` crops the cache back to
the new committed length - 1, so rejected drafts never stay in the context of a later step.

We use transformers' ``DynamicCache`` and ``crop``: measured against a preallocated static cache on this
CPU the difference is within noise for a 135M model at batch 1 (the forward dominates), while
DynamicCache keeps memory proportional to the committed length (docs/benchmarks.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class ForwardResult:
    logits: torch.Tensor  # [m, vocab] float32 logits for the last m fed positions
    seconds: float


class ModelRunner:
    """Forward passes over per-sequence caches. Holds no scheduling state."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.vocab_size = int(model.config.vocab_size)
        self.context_length = int(getattr(model.config, "max_position_embeddings", 2048))
        self.dtype = next(model.parameters()).dtype

    @staticmethod
    def new_cache() -> DynamicCache:
        return DynamicCache()

    @staticmethod
    def cache_len(cache: DynamicCache) -> int:
        return int(cache.get_seq_length())

    @staticmethod
    def rollback(cache: DynamicCache, length: int) -> None:
        """Drop every cached position at or after ``length``.

        transformers 5.x: ``DynamicCache.crop(-n)`` drops the last n positions (a positive argument raises).
        """
        excess = cache.get_seq_length() - length
        if excess > 0:
            cache.crop(-excess)

    @torch.inference_mode()
    def forward(self, cache: DynamicCache, token_ids: list[int], keep: int) -> ForwardResult:
        """Feed ``token_ids`` after the cached prefix; return logits of the last ``keep`` positions."""
        start = time.perf_counter()
        input_ids = torch.tensor([token_ids], dtype=torch.long)
        out = self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=keep)
        logits = out.logits[0, -keep:].float()
        return ForwardResult(logits=logits, seconds=time.perf_counter() - start)

    def prefill(self, cache: DynamicCache, token_ids: list[int], chunk: int) -> float:
        """Feed a prompt prefix in chunks (bounded work per call); returns seconds spent."""
        spent = 0.0
        for i in range(0, len(token_ids), chunk):
            spent += self.forward(cache, token_ids[i:i + chunk], keep=1).seconds
        return spent


def load_model(path: str, dtype: str = "float32") -> PreTrainedModel:
    """Load the prepared transformers directory (never a hub download: local_files_only)."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True).eval()
