"""A suffix-decoding pool is an option of ``auto`` and ``pools:`` exactly like an n-gram pool: its acceptance
is learned per pair version from what the worker reports, and it is chosen when its TPOT is the best
(CONTRIBUTING.md #7: scripted traces drive the learner)."""

from __future__ import annotations

import pytest

from backends.engine.types import RequestStats, RoundStats

from policies.decide import decide, explain
from policies.errors import PolicyError
from policies.features import RequestFeatures
from policies.load import load_policy
from policies.snapshot import PoolState
from policies.stats import LearningState, Outcome
from speculation import SpeculationOverride

POLICY = """
version: 1
slices: [{name: prose}]
pairs:
  ng: {target: {model: m, revision: r1}, draft: {kind: ngram}}
  sx: {target: {model: m, revision: r1}, draft: {kind: suffix, params: {max_tree_depth: DEPTH}}}
pools:
  plain: {proposer: none, workers: ["http://w:1"], speculation: per_request}
  ngram: {proposer: ngram, draft_tokens: 8, pair: ng, workers: ["http://w:1"], speculation: per_request}
  suffix: {proposer: suffix, draft_tokens: 8, pair: sx, workers: ["http://w:1"], speculation: per_request}
rules: [{name: learned, then: ACTION}]
learning: {half_life_s: 100, min_rounds: 100}
"""
FEATURES = RequestFeatures(max_tokens=256)
HEALTHY = {"plain": PoolState(healthy=True), "ngram": PoolState(healthy=True, pair_verified=True),
           "suffix": PoolState(healthy=True, pair_verified=True)}
ROUND_S = 0.1  # seconds per round at k = 8, both pools (the same worker)


def policy(action: str = "auto", depth: int = 24):
    return load_policy(POLICY.replace("ACTION", action).replace("DEPTH", str(depth)), "p.yaml")


def outcome(pool: str, pv: str, reached: list[int], accepted: list[int], rounds: int = 200) -> Outcome:
    """``rounds`` rounds at k = 8 with these per-position counts; TPOT from ROUND_S per round."""
    tokens = rounds + sum(accepted)
    return Outcome(route="default", slice="prose", pool=pool, pair_version=pv, proposer=pool, draft_tokens=8,
                   completion_tokens=tokens + 1, verify_ct=rounds, reached_per_position=reached,
                   accepted_per_position=accepted, tpot_s=ROUND_S * rounds / tokens)


def learned(p) -> LearningState:
    """plain at 50 ms/token; ngram accepts each draft with a_j = 0.7 (E[P](8) = 3.21, 1.6x faster than
    plain); suffix with a_j ~ 0.95 (E[P](8) = 7.37, 3.7x)."""
    state = LearningState(p.learning)
    state.record(Outcome(route="default", slice="prose", pool="plain", completion_tokens=301, tpot_s=0.05))
    state.record(outcome("ngram", p.pool_pair_version("ngram"),
                         reached=[200, 140, 98, 69, 48, 34, 24, 17], accepted=[140, 98, 69, 48, 34, 24, 17, 12]))
    state.record(outcome("suffix", p.pool_pair_version("suffix"),
                         reached=[200, 190, 180, 171, 162, 154, 146, 139],
                         accepted=[190, 180, 171, 162, 154, 146, 139, 132]))
    return state


def test_a_policy_with_a_suffix_pool_loads():
    p = policy()
    assert (p.pools["suffix"].proposer, p.pools["suffix"].k_range) == ("suffix", (8, 8))
    assert p.pairs["sx"].draft.kind == "suffix" and p.pairs["sx"].draft.params == {"max_tree_depth": 24}
    assert p.pool_pair_version("suffix") not in ("", p.pool_pair_version("ngram"))


def test_a_suffix_pool_needs_a_suffix_pair():
    with pytest.raises(PolicyError) as exc:
        load_policy(POLICY.replace("pair: sx", "pair: ng").replace("ACTION", "auto").replace("DEPTH", "24"),
                    "p.yaml")
    assert any("proposer suffix cannot run pair 'ng'" in e for e in exc.value.errors), exc.value.errors


@pytest.mark.parametrize("action", ["auto", "{pools: [ngram, suffix]}"])
def test_auto_chooses_suffix_when_its_learned_acceptance_is_best(action):
    p = policy(action)
    snap = learned(p).snapshot(0.0, HEALTHY, 1)
    trace = explain(p, FEATURES, snap)
    by_pool = {c.pool: c for c in trace.candidates}
    assert set(by_pool) == {"", "ngram", "suffix"}
    assert (round(by_pool["ngram"].expected_accept_length, 2), round(by_pool["suffix"].expected_accept_length, 2)) == (
        3.21, 7.38)  # measured tokens per round
    # one request each: 1.6x and 3.7x measured, shrunk a little toward plain by the prior
    assert by_pool["suffix"].speedup == pytest.approx(3.4, abs=0.15)
    assert by_pool["ngram"].speedup == pytest.approx(1.55, abs=0.1)
    d = decide(p, FEATURES, snap)
    assert (d.pool, d.proposer, d.draft_tokens, d.bypass, d.explored) == ("suffix", "suffix", 8, False, False)
    assert d.speculation_override == SpeculationOverride(proposer="suffix", draft_tokens=8, adaptive=False)
    assert d.reason.startswith("rule 'learned' auto: pool 'suffix' k=8, posterior-mean speedup ")


def test_suffix_acceptance_is_learned_per_pair_version():
    """A new suffix setting (the tree depth) is a new pair version: its statistics start from nothing, so
    auto serves the measured ngram pool until the new version has evidence of its own."""
    old, new = policy(depth=24), policy(depth=32)
    assert old.pool_pair_version("suffix") != new.pool_pair_version("suffix")
    assert old.pool_pair_version("ngram") == new.pool_pair_version("ngram")
    snap = learned(old).snapshot(0.0, HEALTHY, 1)
    assert decide(old, FEATURES, snap).pool == "suffix"
    d = decide(new, FEATURES, snap)
    assert (d.pool, d.draft_tokens, d.bypass) == ("ngram", 8, False)
    cold = {c.pool: c for c in explain(new, FEATURES, snap).candidates}["suffix"]
    assert cold.samples == 0 and cold.speedup == pytest.approx(1.0)  # starts at plain's TPOT


def test_a_proposer_that_drafts_fewer_than_k_is_predicted_at_its_observed_accept_length():
    """Half the rounds draft all 8 tokens and accept them, half draft nothing (no match): 5.0 tokens per
    round were observed. The worker counts position j as reached in every round whose budget included it
    and whose drafts 1..j-1 were accepted (RequestStats.record), so a_1 = 0.5 and E[P](8) = 5; counting
    only drafted positions gave a_j = 1 and predicted 9."""
    p = policy()
    state = LearningState(p.learning)
    state.record(Outcome(route="default", slice="prose", pool="plain", completion_tokens=301, tpot_s=0.05))
    stats = RequestStats()  # the worker's own counting of these rounds
    for drafted in (8, 0) * 100:
        stats.record(RoundStats(k=drafted, accepted=drafted, budget=8, committed=drafted + 1, bonus=drafted == 8,
                                draft_s=0.0, verify_s=0.0, overhead_s=0.0))
    assert stats.reached_per_position == [200] + [100] * 7 and stats.accepted_per_position == [100] * 8
    short = outcome("suffix", p.pool_pair_version("suffix"), reached=stats.reached_per_position,
                    accepted=stats.accepted_per_position)
    state.record(short)
    snap = state.snapshot(0.0, HEALTHY, 1)
    summary, _ = snap.acceptance("default", "prose", "suffix", p.pool_pair_version("suffix"), 100)
    assert summary.mean_accept_length == 5.005  # 1001 tokens over 200 rounds
    suffix = {c.pool: c for c in explain(p, FEATURES, snap).candidates}["suffix"]
    assert suffix.expected_accept_length == pytest.approx(5.0, abs=0.01)
