"""The n-gram proposer's incremental index against a brute-force search of the context."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.engine.proposers.ngram import NgramProposer
from backends.engine.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def brute_force(context: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Longest n first; for that n, the LATEST earlier occurrence of the last n tokens (one that ends
    before the last token); propose the up-to-k tokens that followed it."""
    for n in range(min(ngram_max, len(context)), ngram_min - 1, -1):
        suffix = context[-n:]
        for end in range(len(context) - 1, n - 1, -1):
            if context[end - n:end] == suffix:
                return context[end:end + k]
    return []


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    cut_points=st.lists(st.integers(1, 40), max_size=6),
    k=st.integers(1, 8),
    ngram_min=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_index_matches_brute_force_as_the_context_grows(tokens, cut_points, k, ngram_min, extra):
    proposer = NgramProposer(ngram_min, ngram_min + extra)
    gen = torch.Generator()
    for cut in sorted({min(c, len(tokens)) for c in cut_points} | {len(tokens)}):
        context = tokens[:cut]
        proposal = proposer.propose(context, k, GREEDY, None, gen)
        assert proposal.tokens == brute_force(context, k, ngram_min, ngram_min + extra), context
        assert proposal.draft_probs is None  # deterministic: q is one-hot


def test_known_lookup():
    proposer = NgramProposer(1, 3)
    # "1 2 3" occurs twice; the latest earlier occurrence of the suffix "2 3" is followed by "9 1"
    context = [1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2, 3]
    assert proposer.propose(context, 2, GREEDY, None, torch.Generator()).tokens == [9, 1]
    assert NgramProposer(1, 1).propose([5, 6, 7], 3, GREEDY, None, torch.Generator()).tokens == []
