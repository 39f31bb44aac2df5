"""N-gram prompt lookup: propose the continuation of the most recent earlier occurrence of the
context's last n tokens (n from ``ngram_max`` down to ``ngram_min``), in the prompt or the output.

Model-free and deterministic, so q is one-hot and ``draft_probs`` is None (see verify.py). The index
maps each n-gram to the position right after its latest occurrence and is extended incrementally as
tokens commit, so a lookup costs O(ngram_max) instead of a scan of the context.
"""

from __future__ import annotations

import time

import torch

from backends.engine.proposers.base import EMPTY, Proposal, SequenceProposer
from backends.engine.sampling import PenaltyState
from backends.engine.types import SamplingParams


class NgramProposer(SequenceProposer):
    name = "ngram"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._next_after: dict[tuple[int, ...], int] = {}  # n-gram -> index right after its last occurrence
        self._indexed = 0  # n-grams ending before this index are in the map

    def _extend_index(self, context: list[int]) -> None:
        # Index n-grams that END strictly before the last token, so the context's own suffix is never
        # its own match; later occurrences overwrite earlier ones (most recent wins).
        limit = len(context) - 1
        for end in range(max(self._indexed, 1), limit + 1):
            for n in range(self.ngram_min, self.ngram_max + 1):
                if end - n < 0:
                    break
                self._next_after[tuple(context[end - n:end])] = end
        self._indexed = max(self._indexed, limit + 1)

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        penalty: PenaltyState | None,
        generator: torch.Generator,
    ) -> Proposal:
        start = time.perf_counter()
        self._extend_index(context)
        for n in range(min(self.ngram_max, len(context)), self.ngram_min - 1, -1):
            follow = self._next_after.get(tuple(context[-n:]))
            if follow is not None and follow < len(context):
                tokens = context[follow:follow + k]
                return Proposal(tokens=tokens, draft_probs=None, seconds=time.perf_counter() - start)
        return EMPTY
