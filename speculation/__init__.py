"""The speculation vocabulary, defined once: the proposer names, the draft-length bound, the per-round
controllers' names and vLLM's per-batch-size k table. The policy (``policies/``), the worker and the engine
(``backends/``), replay and telemetry import these names from here, so a new proposer or a wider k is one edit.

Words (docs/architecture.md, "Vocabulary"): per round a proposer drafts k tokens, the target accepts a prefix
of them and adds one token of its own; k = 0 (proposer ``none``) is plain decoding.
"""

from __future__ import annotations

from typing import Literal

# What the embedded engine runs (``custom_params.speculation.proposer``, ``SpeculationParams.proposer``).
# ``hybrid`` drafts from n-gram and suffix every round and picks the source per round (backends/engine/source_choice.py)
Proposer = Literal["none", "ngram", "draft_model", "suffix", "hybrid"]
PROPOSERS: tuple[str, ...] = ("none", "ngram", "draft_model", "suffix", "hybrid")
# What a policy's pool may name: the engine's proposers and those only SGLang servers run (``eagle``,
# ``eagle3``, ``standalone``: a separate draft model), each pool being one server configuration.
PoolProposer = Literal["none", "ngram", "suffix", "hybrid", "draft_model", "eagle", "eagle3", "standalone"]
POOL_PROPOSERS: tuple[str, ...] = ("none", "ngram", "suffix", "hybrid", "draft_model", "eagle", "eagle3", "standalone")
MODEL_FREE: frozenset[str] = frozenset({"ngram", "suffix", "hybrid"})  # drafts follow from the ids alone (replay is exact)
NgramMatch = Literal["earliest", "latest"]
NGRAM_MATCHES: tuple[str, ...] = ("earliest", "latest")
# The per-round controllers of backends/engine/adaptive.py: specgate's, SGLang's --speculative-adaptive, vLLM's table
ADAPTIVE_STRATEGIES: tuple[str, ...] = ("beta", "sglang", "vllm")
MAX_DRAFT_TOKENS = 16  # the most drafts one round may verify (k), per request and per round
SCOPE_MAX_CHARS = 128  # ``custom_params.speculation.scope``: whose earlier outputs suffix decoding drafts from


def parse_k_by_batch(text: str) -> tuple[tuple[int, int], ...]:
    """vLLM's schedule written ``"1-3:8,4-15:4,16-4096:0"`` (inclusive ranges, ``LO-HI:K`` or ``LO:K``) as
    ascending (lowest batch size, k) pairs."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        span, sep, k = item.partition(":")
        lo = span.split("-")[0]
        if not sep or not lo.isdigit() or not k.isdigit() or int(lo) < 1:
            raise ValueError(f"k_by_batch: {item!r} is not LO-HI:K or LO:K (batch sizes >= 1, k >= 0), "
                             "e.g. 1-3:8,4-15:4,16-4096:0")
        pairs.append((int(lo), int(k)))
    if not pairs:
        raise ValueError("k_by_batch is empty; write ranges like 1-3:8,4-15:4,16-4096:0")
    return tuple(sorted(pairs))
