"""The proposer interface: draft k tokens for one sequence, optionally with their draft probabilities q.

A proposer never commits anything (docs/architecture.md, "The four properties", 1). It sees the committed context (prompt +
committed output) and may keep per-sequence state (an n-gram index, a draft model's KV cache), which
it must bring back to the committed prefix itself: ``observe`` tells it what the round committed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from backends.engine.sampling import PenaltyState
from backends.engine.types import SamplingParams


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: list[int]  # [k'] with k' <= k (a proposer may find fewer, even none)
    draft_probs: torch.Tensor | None  # [k', vocab] q for sampled verification; None = deterministic
    seconds: float
    match: int = 0  # n-gram: tokens of the context suffix that found the draft (0: not an n-gram draft)
    # suffix: the length of the context suffix its tree matched, and arctic-inference's score of the draft
    # (the sum of its tokens' estimated probabilities); 0 for the other proposers
    suffix_match: int = 0
    suffix_score: float = 0.0
    source: str = ""  # hybrid: which of its sources drafted (source_choice.SOURCES); "" for the others


EMPTY = Proposal(tokens=[], draft_probs=None, seconds=0.0)


class SequenceProposer(ABC):
    """Per-sequence proposer state. Created by the engine when a sequence starts decoding.

    ``prefix_drafts``: the draft for k is the first k tokens of the draft for more, and drafting costs
    microseconds, so a per-round controller may look at the longest draft (and its ``match``) before it
    picks k (n-gram); otherwise it picks k first (a draft model pays per token)."""

    name: str
    prefix_drafts: bool = False

    @abstractmethod
    def propose(
        self,
        context: list[int],  # committed prompt + output ids
        k: int,
        params: SamplingParams,
        penalty: PenaltyState | None,
        generator: torch.Generator,
    ) -> Proposal: ...

    def observe(self, proposed: int, accepted: int, context: list[int]) -> None:
        """The round's outcome; ``context`` is the committed context after it. Default: nothing."""

    def release(self) -> None:
        """Free per-sequence memory (caches). Default: nothing."""

    @property
    def cached_tokens(self) -> int:
        """Positions held in this proposer's own KV cache (0 for model-free proposers)."""
        return 0
