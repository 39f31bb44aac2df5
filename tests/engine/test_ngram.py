"""The n-gram proposer's incremental index against a brute-force search of the context."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.engine.proposers.ngram import NgramProposer
from backends.engine.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def brute_force(context: list[int], k: int, ngram_min: int, ngram_max: int, match: str) -> list[int]:
    """Longest n first; for that n, the earliest (or latest) earlier occurrence of the last n tokens (one
    that ends before the last token); propose the up-to-k tokens that followed it."""
    for n in range(min(ngram_max, len(context)), ngram_min - 1, -1):
        suffix = context[-n:]
        ends = range(n, len(context)) if match == "earliest" else range(len(context) - 1, n - 1, -1)
        for end in ends:
            if context[end - n:end] == suffix:
                return context[end:end + k]
    return []


def transformers_prompt_lookup(context: list[int], k: int, max_ngram: int) -> list[int]:
    """transformers' PromptLookupCandidateGenerator.get_candidates, run on the same context."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    generator = PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=max_ngram,
                                               max_length=len(context) + k + 2)
    candidates, _ = generator.get_candidates(torch.tensor([context]))
    return candidates[0, len(context):].tolist()


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    cut_points=st.lists(st.integers(1, 40), max_size=6),
    k=st.integers(1, 8),
    ngram_min=st.integers(1, 3),
    extra=st.integers(0, 3),
    match=st.sampled_from(["earliest", "latest"]),
)
def test_index_matches_brute_force_as_the_context_grows(tokens, cut_points, k, ngram_min, extra, match):
    proposer = NgramProposer(ngram_min, ngram_min + extra, match)
    gen = torch.Generator()
    for cut in sorted({min(c, len(tokens)) for c in cut_points} | {len(tokens)}):
        context = tokens[:cut]
        proposal = proposer.propose(context, k, GREEDY, None, gen)
        assert proposal.tokens == brute_force(context, k, ngram_min, ngram_min + extra, match), context
        assert proposal.draft_probs is None  # deterministic: q is one-hot


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=2, max_size=40), k=st.integers(1, 8),
       max_ngram=st.integers(1, 4))
def test_earliest_match_drafts_what_transformers_prompt_lookup_drafts(tokens, k, max_ngram):
    """With transformers' n-gram range (1..max_matching_ngram_size), ``earliest`` IS its prompt lookup."""
    ours = NgramProposer(1, max_ngram, "earliest").propose(tokens, k, GREEDY, None, torch.Generator()).tokens
    assert ours == transformers_prompt_lookup(tokens, k, max_ngram), tokens


def test_known_lookup():
    # "1 2 3" occurs twice before the suffix: the earliest occurrence is followed by "4 5", the latest by "9 1"
    context = [1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2, 3]
    assert NgramProposer(1, 3, "earliest").propose(context, 2, GREEDY, None, torch.Generator()).tokens == [4, 5]
    assert NgramProposer(1, 3, "latest").propose(context, 2, GREEDY, None, torch.Generator()).tokens == [9, 1]
    # the longest match wins over an earlier shorter one: "7 2 3" occurs once, after "2 3" first occurred
    context = [2, 3, 0, 7, 2, 3, 6, 7, 2, 3]
    assert NgramProposer(1, 3).propose(context, 1, GREEDY, None, torch.Generator()).tokens == [6]
    assert NgramProposer(1, 2).propose(context, 1, GREEDY, None, torch.Generator()).tokens == [0]
    assert NgramProposer(1, 1).propose([5, 6, 7], 3, GREEDY, None, torch.Generator()).tokens == []
