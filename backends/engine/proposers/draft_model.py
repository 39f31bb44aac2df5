"""Draft-model proposer: any causal LM that shares the target's tokenizer, with its own KV cache.

The draft samples its k tokens autoregressively from q, processed exactly like p (sampling.py), and
returns q for the rejection test; ``propose_batch`` drafts for every sequence of an engine step at once
(one draft forward per draft position over all of them). Its cache follows the committed prefix: before
each proposal it is cut to the longest common prefix of what it was fed and the committed context (so
rejected drafts leave it), then the missing committed tokens are fed.

The engine's self-draft is ``ModelRunner.truncated(N)``: the target's first N decoder layers + final norm
+ lm_head, sharing the target's weight tensors (no extra weight memory); ``layer_truncated_draft`` builds
the same model for transformers (the reference benchmarks' assisted generation). On this CPU it loses (low
acceptance for the time it costs); it exists so the policy can measure that and learn to avoid it.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from backends.engine.proposers.base import Proposal, SequenceProposer
from backends.engine.runner import Feed, ModelRunner
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
        return propose_batch([DraftJob(self, context, k, params, penalty, generator)])[0]

    def release(self) -> None:
        self.cache = self.runner.new_cache()
        self.fed = []

    @property
    def cached_tokens(self) -> int:
        return len(self.fed)


@dataclass(frozen=True, slots=True)
class DraftJob:
    proposer: DraftModelProposer
    context: list[int]
    k: int
    params: SamplingParams
    penalty: PenaltyState | None
    generator: torch.Generator


def propose_batch(jobs: list[DraftJob]) -> list[Proposal]:
    """Draft for several sequences at once: draft step j is ONE forward of the draft model over every job
    that still wants a token (the first step also feeds each job's missing committed tokens). Each job's
    tokens are drawn exactly as alone (its own processed logits, penalty history and generator), so batching
    changes the time, not the drafts. Every proposal reports the batch's wall time (its latency)."""
    start = time.perf_counter()
    runner = jobs[0].proposer.runner if jobs else None
    tokens: list[list[int]] = [[] for _ in jobs]
    q_rows: list[list[torch.Tensor]] = [[] for _ in jobs]
    feeds = [job.proposer._sync(job.context) for job in jobs]
    for j in range(max((job.k for job in jobs), default=0)):
        active = [i for i, job in enumerate(jobs) if job.k > j]
        result = runner.forward_batch([Feed(jobs[i].proposer.cache, feeds[i], 1) for i in active])
        for i, logits in zip(active, result.logits):
            job = jobs[i]
            job.proposer.fed.extend(feeds[i])
            scaled = process_logits(logits, job.params, job.penalty, tokens[i], job.proposer.stop_ids, start=j)
            if job.params.greedy:
                token = int(scaled[0].argmax())
            else:
                q = probs_from_logits(scaled, job.params)[0]
                token = sample(q, job.generator)
                q_rows[i].append(q)
            tokens[i].append(token)
            feeds[i] = [token]
    seconds = time.perf_counter() - start
    return [Proposal(tokens=t, draft_probs=torch.stack(q) if q else None, seconds=seconds)
            for t, q in zip(tokens, q_rows)]
