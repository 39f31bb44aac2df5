"""Draft-model proposer: any causal LM that shares the target's tokenizer, with its own KV cache.

The draft samples its k tokens autoregressively from q, processed exactly like p (sampling.py), and
returns q for the rejection test. Its cache follows the committed prefix: before each proposal it is
cropped to the longest common prefix of what it was fed and the committed context (so rejected drafts
leave it), then the missing committed tokens are fed.

``layer_truncated_draft`` builds the self-draft: the target's first N decoder layers + final norm +
lm_head, sharing the target's weight tensors (no extra weight memory). On this CPU it loses (low
acceptance for the time it costs); it exists so the policy can measure that and learn to avoid it.
"""

from __future__ import annotations

import copy
import time

import torch
from transformers import PreTrainedModel

from backends.engine.proposers.base import Proposal, SequenceProposer
from backends.engine.runner import ModelRunner
from backends.engine.sampling import PenaltyState, probs_from_logits, process_logits, sample
from backends.engine.types import SamplingParams


def layer_truncated_draft(target: PreTrainedModel, layers: int) -> PreTrainedModel:
    """A model made of the target's first ``layers`` decoder layers, sharing its tensors."""
    total = target.config.num_hidden_layers
    if not 1 <= layers < total:
        raise ValueError(f"draft layers must be in 1..{total - 1}, got {layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    with torch.device("meta"):
        draft = type(target)(config)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(target.model.layers[:layers])
    draft.model.norm = target.model.norm
    draft.model.rotary_emb = target.model.rotary_emb
    draft.lm_head = target.lm_head
    return draft.eval()


class DraftModelProposer(SequenceProposer):
    name = "draft_model"

    def __init__(self, runner: ModelRunner, stop_ids: frozenset[int]) -> None:
        self.runner = runner
        self.stop_ids = stop_ids
        self.cache = runner.new_cache()
        self.fed: list[int] = []  # tokens whose keys/values are in self.cache, in order

    def _sync(self, context: list[int]) -> list[int]:
        """Crop the cache to the common prefix with ``context``; return the tokens still to feed."""
        common = 0
        limit = min(len(self.fed), len(context) - 1)  # always re-feed at least the last token
        while common < limit and self.fed[common] == context[common]:
            common += 1
        self.runner.rollback(self.cache, common)
        self.fed = self.fed[:common]
        return context[common:]

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        penalty: PenaltyState | None,
        generator: torch.Generator,
    ) -> Proposal:
        start = time.perf_counter()
        feed = self._sync(context)
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        for j in range(k):
            logits = self.runner.forward(self.cache, feed, keep=1).logits  # [1, vocab]
            self.fed.extend(feed)
            scaled = process_logits(logits, params, penalty, tokens, self.stop_ids, start=j)
            if params.greedy:
                token = int(scaled[0].argmax())
            else:
                q = probs_from_logits(scaled, params)[0]
                token = sample(q, generator)
                q_rows.append(q)
            tokens.append(token)
            feed = [token]
        draft_probs = torch.stack(q_rows) if q_rows else None
        return Proposal(tokens=tokens, draft_probs=draft_probs, seconds=time.perf_counter() - start)

    def release(self) -> None:
        self.cache = self.runner.new_cache()
        self.fed = []

    @property
    def cached_tokens(self) -> int:
        return len(self.fed)
