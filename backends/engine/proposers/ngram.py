"""N-gram prompt lookup: find the longest suffix of the context (n from ``ngram_max`` down to ``ngram_min``
tokens) that occurred earlier, in the prompt or the output, and propose the up-to-k tokens that followed
that occurrence.

Which occurrence matters. ``earliest`` (the default) takes the first occurrence, as transformers'
``PromptLookupCandidateGenerator`` and vLLM's n-gram proposer do; ``latest`` takes the most recent one. The earliest occurrence is usually in the prompt, whose continuation is the text
being copied (code to edit, a document to quote) and runs a full k tokens; the latest is often a few
tokens back in the output, where the continuation runs into the end of the context and gets cut short, or
follows a repetition the model is about to leave, so ``earliest`` drafts more accepted tokens per round
(docs/benchmarks.md, "Proposers: n-gram vs prompt lookup").

Model-free and deterministic, so q is one-hot and ``draft_probs`` is None (see verify.py). The index maps
each n-gram to the position right after its first (or latest) occurrence and grows incrementally as tokens
commit, so a lookup costs O(ngram_max) instead of a scan of the context.
"""

from __future__ import annotations

import time

import torch

from backends.engine.proposers.base import EMPTY, Proposal, SequenceProposer
from backends.engine.sampling import PenaltyState
from backends.engine.types import NgramMatch, SamplingParams


class NgramProposer(SequenceProposer):
    name = "ngram"
    prefix_drafts = True

    def __init__(self, ngram_min: int = 1, ngram_max: int = 12, match: NgramMatch = "earliest") -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.match = match
        self._next_after: dict[tuple[int, ...], int] = {}  # n-gram -> index right after the chosen occurrence
        self._indexed = 0  # n-grams ending before this index are in the map

    def _extend_index(self, context: list[int]) -> None:
        # Index n-grams that END strictly before the last token, so the context's own suffix is never its
        # own match (and every indexed occurrence has at least one token after it).
        limit = len(context) - 1
        earliest = self.match == "earliest"
        index = self._next_after
        for end in range(max(self._indexed, 1), limit + 1):
            for n in range(self.ngram_min, self.ngram_max + 1):
                if end - n < 0:
                    break
                key = tuple(context[end - n:end])
                if earliest:
                    index.setdefault(key, end)
                else:
                    index[key] = end
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
                return Proposal(tokens=tokens, draft_probs=None, seconds=time.perf_counter() - start, match=n)
        return EMPTY
