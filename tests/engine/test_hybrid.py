"""The hybrid proposer's choice between n-gram and suffix (backends/engine/source_choice.py), driven by
scripted rounds (CONTRIBUTING.md #7), and the proposer's bookkeeping: both sources see every committed token."""

from __future__ import annotations

import pytest
import torch

from backends.engine.adaptive import PooledAcceptance
from backends.engine.proposers.hybrid import HybridProposer
from backends.engine.proposers.ngram import NgramProposer
from backends.engine.proposers.suffix import SuffixStore
from backends.engine.source_choice import (
    DISAGREE, SOURCES, SUFFIX_CONTEXTS, UNSURE, SourceRule, agreement, contexts, scored, suffix_context,
)
from backends.engine.step_costs import StepCosts
from backends.engine.types import SamplingParams, SpeculationParams

FP32 = {1: 0.043, 2: 0.050, 3: 0.056, 5: 0.068, 9: 0.082, 17: 0.110}
COSTS = StepCosts(forward_s={(1, width): s for width, s in FP32.items()})
NGRAM, SUFFIX = SOURCES.index("ngram"), SOURCES.index("suffix")
CTX_N, CTX_S = contexts(5, 6, 8.0, 8)  # n-gram match 5 (bucket 4), suffix match 6 (bucket 4), sure
DRAFT_N, DRAFT_S = [10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27]


def rule(adaptive: bool, k_max: int = 8, seed: int = 0, pooled: PooledAcceptance | None = None) -> SourceRule:
    return SourceRule(k_max, adaptive, lambda k: [COSTS.round_s("hybrid", j) for j in range(k + 1)], seed=seed,
                      pooled=pooled)


def play(r: SourceRule, good: str, rounds: int) -> list[tuple[str, int]]:
    """``rounds`` rounds where both sources draft 8 tokens and only ``good``'s are the target's (the target
    commits the served draft's accepted run and one more token; ``good`` "neither": no draft is accepted);
    the rule's choices, in order."""
    chosen = []
    for _ in range(rounds):
        pick, k = r.choose([(len(DRAFT_N), CTX_N), (len(DRAFT_S), CTX_S)])
        chosen.append((SOURCES[pick], k))
        served = DRAFT_N if pick == NGRAM else DRAFT_S
        target = {"ngram": DRAFT_N, "suffix": DRAFT_S}.get(good, [98] * 8) + [99]
        run = 0
        while run < k and served[run] == target[run]:
            run += 1
        r.observe([(DRAFT_N, CTX_N), (DRAFT_S, CTX_S)], target[:run + 1])
    return chosen


def test_scored_is_the_accepted_run_and_censors_past_the_committed_tokens():
    assert scored([1, 2, 3], [1, 2, 9]) == (3, 2)  # rejected at position 3
    assert scored([1, 2, 3], [9]) == (3, 0)
    assert scored([1, 2, 3], [1, 2, 3, 4]) == (3, 3)  # the whole draft accepted
    assert scored([1, 2, 3, 4], [1, 2]) == (2, 2)  # censored: positions 3 and 4 are not observed
    assert scored([1, 2], [1, 2]) == (2, 2)


def test_suffix_contexts_are_buckets_apart_from_ngrams_and_unsure_drafts_apart():
    assert [suffix_context(m, 2.0, 2) for m in (0, 1, 2, 3, 4, 7, 8, 15, 16, 24)] == [
        0, SUFFIX_CONTEXTS + 1, SUFFIX_CONTEXTS + 2, SUFFIX_CONTEXTS + 3, SUFFIX_CONTEXTS + 4, SUFFIX_CONTEXTS + 4,
        SUFFIX_CONTEXTS + 8, SUFFIX_CONTEXTS + 8, SUFFIX_CONTEXTS + 16, SUFFIX_CONTEXTS + 16]
    assert suffix_context(3, 1.0, 2) == SUFFIX_CONTEXTS + 3  # mean probability 0.5: sure enough
    assert suffix_context(3, 0.9, 2) == SUFFIX_CONTEXTS + UNSURE + 3
    assert suffix_context(3, 0.0, 0) == 0  # no draft
    assert contexts(5, 6, 8.0, 8) == (4, SUFFIX_CONTEXTS + 4)


def test_fixed_k_ties_go_to_the_longer_draft_then_suffix():
    r = rule(adaptive=False)
    assert r.choose([(8, CTX_N), (8, CTX_S)]) == (SUFFIX, 8)
    assert r.choose([(8, CTX_N), (3, CTX_S)]) == (NGRAM, 8)
    assert r.choose([(0, 0), (0, 0)]) == (SUFFIX, 0)
    assert r.choose([(12, CTX_N), (0, 0)]) == (NGRAM, 8)  # a draft longer than k serves k


@pytest.mark.parametrize("good", ["ngram", "suffix"])
def test_fixed_k_learns_to_serve_the_source_whose_drafts_are_accepted(good):
    """Served or not, both drafts are scored every round: after one round the rule knows which is accepted,
    and it keeps serving that one."""
    chosen = play(rule(adaptive=False), good, 10)
    assert chosen[0] == ("suffix", 8)  # no evidence: the tie goes to suffix
    assert chosen[1:] == [(good, 8)] * 9


@pytest.mark.parametrize("good", ["ngram", "suffix"])
def test_adaptive_learns_the_source_and_drafts_long_where_it_is_accepted(good):
    chosen = play(rule(adaptive=True, seed=7), good, 30)
    assert chosen[10:] == [(good, 8)] * 20


def test_adaptive_stops_drafting_when_neither_source_is_accepted():
    chosen = play(rule(adaptive=True, seed=3), "neither", 60)
    assert sum(k for _, k in chosen[20:]) <= 4  # a rare probe at most (both first positions learn for free)


def test_a_plain_round_still_teaches_both_sources_their_first_position():
    r = rule(adaptive=False)
    r.observe([(DRAFT_N, CTX_N), (DRAFT_S, CTX_S)], [DRAFT_N[0]])  # k = 0: one committed token
    hits_n, misses_n = r.posterior.evidence[CTX_N].values()
    hits_s, misses_s = r.posterior.evidence[CTX_S].values()
    assert (hits_n[:2], misses_n[:2]) == ([1.0, 0.0], [0.0, 0.0])  # censored after position 1
    assert (hits_s[:2], misses_s[:2]) == ([0.0, 0.0], [1.0, 0.0])


def test_the_engines_pooled_evidence_starts_a_new_sequence():
    pooled = PooledAcceptance()
    play(rule(adaptive=False, pooled=pooled), "ngram", 5)
    assert rule(adaptive=False, pooled=pooled).choose([(8, CTX_N), (8, CTX_S)]) == (NGRAM, 8)


def test_hybrid_needs_the_beta_strategy_when_adaptive():
    with pytest.raises(ValueError, match="^proposer hybrid picks its source and k with strategy beta, got 'sglang'"):
        SpeculationParams(proposer="hybrid", draft_tokens=4, adaptive=True, strategy="sglang")


def test_both_sources_observe_every_committed_token_whichever_is_served():
    """The suffix source's trees take the committed tokens of a round n-gram served (and vice versa the
    n-gram index reads the context): a later request of the scope drafts them from the global tree."""
    store = SuffixStore()
    greedy, gen = SamplingParams(temperature=0.0), torch.Generator()
    prompt = [1, 2, 3, 4, 1, 2, 3]
    proposer = HybridProposer(NgramProposer(), store.open("s", prompt), rule(adaptive=False))
    proposal = proposer.propose(prompt, 4, greedy, None, gen)
    assert (proposal.source, proposal.tokens) == ("ngram", [4, 1, 2, 3])  # n-gram: longer than suffix's
    context = prompt + [4, 1, 2, 3, 50]  # all accepted, then the bonus token
    proposer.observe(4, 4, context)
    context += [51, 52]
    proposer.observe(0, 0, context)  # a round with no drafts (k capped to 0) still feeds both trees
    proposer.release()
    later = store.open("s", [7, 50, 51])
    assert later.propose([7, 50, 51], 4, greedy, None, gen).tokens == [52]
    later.release()


def test_drafts_that_disagree_are_learned_in_contexts_of_their_own():
    """Both drafts' first tokens differ: both sources' contexts move apart (at most one of them is right);
    drafts that agree, or a source drafting alone, keep the match length's context."""
    assert (agreement(None, 5), agreement(5, None), agreement(5, 5), agreement(5, 6)) == (0, 0, 0, DISAGREE)
    alone = contexts(3, 4, 3.0, 4)
    assert contexts(3, 4, 3.0, 4, DISAGREE) == (alone[0] + DISAGREE, alone[1] + DISAGREE)
    assert contexts(0, 0, 0.0, 0, DISAGREE) == (0, 0)  # a source that found nothing has no context
    contexts_of = {c for m in (1, 2, 3, 4, 8) for s in (1, 2, 3, 4, 8, 16) for score in (0.0, 99.0)
                   for c in contexts(m, s, score, 4)}
    assert not contexts_of & {c + DISAGREE for c in contexts_of}  # apart from every context that agrees
