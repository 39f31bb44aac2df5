"""The learner at a load it was not warmed up at (borrowed cost slopes, the slope probe, plain decoding
unconfirmed near a new load) and the explorations in flight the gateway passes to ``decide``."""

from __future__ import annotations

import math
import random

from policies.auto import Candidate, slope_probe
from policies.decide import decide, explain, exploration_key
from policies.load import load_policy
from policies.stats import LearningState, Outcome
from tests.policies.test_learner import FEATURES, HEALTHY, POLICY, plain_outcome, policy, spec_outcome


def _k1_outcome(pv: str, round_s: float, concurrency: int = 1) -> Outcome:
    """One k=1 request: 50 rounds, 90 tokens after the first, ``round_s`` seconds per round."""
    return Outcome(route="default", slice="prose", pool="ngram", pair_version=pv, proposer="ngram", draft_tokens=1,
                   completion_tokens=91, verify_ct=50, reached_per_position=[50], accepted_per_position=[40],
                   tpot_s=round_s * 50 / 90, timestamp=0.0, concurrency=concurrency)


def test_a_new_load_borrows_the_cost_slope_measured_at_another_instead_of_probing_it_again() -> None:
    """c=1 measured the round time at k=1 (0.07 s) and k=2 (0.088 s): c0 0.052, c1 0.018. At c=4 only k=2
    was measured (0.176 s, twice the c=1 round): the c=1 line scaled by 2 predicts k=1 at 0.14 s, and no
    slope probe is started. Without the c=1 slope, the same c=4 evidence probes k=1."""
    p = load_policy(POLICY.replace("{min: 2, max: 2}", "{min: 1, max: 2}").replace("REV", "r1")
                    .replace("EXPLORE", "0.0").replace("GAIN", "1.05").replace("COLD", "1.0"), "t.yaml")
    pv = p.pool_pair_version("ngram")
    states = LearningState(p.learning), LearningState(p.learning)
    for state in states:
        state.record(plain_outcome(0.05))
        state.record(spec_outcome(pv, rounds=150))  # c=1, k=2: 0.088 s per round
        state.record(plain_outcome(0.1, concurrency=4))
        state.record(spec_outcome(pv, rounds=150, tpot=0.08, concurrency=4))  # c=4, k=2: 0.176 s per round
    for _ in range(2):
        states[0].record(_k1_outcome(pv, 0.07))  # 100 rounds at k=1, c=1: the slope is measured there
    snap = states[0].snapshot(0.0, HEALTHY, 4)
    assert snap.measured_slope("ngram", 100) is snap.data.rounds["ngram|0"]
    k1, k2 = explain(p, FEATURES, snap).candidates
    assert not k1.slope_unknown and k1.note == "acceptance curve x round-time fit (slope from another load)"
    assert math.isclose(k1.predicted_tpot_ms, 0.14 / k1.expected_accept_length * 1e3)
    assert math.isclose(k2.predicted_tpot_ms, 0.176 / k2.expected_accept_length * 1e3)
    d = decide(p, FEATURES, snap, rng=random.Random(0))  # k=1: 0.14 s / 1.8 beats k=2: 0.176 s / 2.2
    assert not d.explored and (d.pool, d.draft_tokens) == ("ngram", 1)
    d = decide(p, FEATURES, states[1].snapshot(0.0, HEALTHY, 4), rng=random.Random(0))
    assert d.exploration == "slope"
    assert d.reason.startswith("rule 'learned' auto: exploring the cost slope of pool 'ngram' k=1")


def test_the_slope_probe_is_midway_between_the_smallest_and_the_served_k() -> None:
    options = [Candidate(pool="ngram", draft_tokens=k, eligible=True, note="", speedup=1.5, slope_unknown=True)
               for k in range(1, 9)]
    assert slope_probe(options, options[7], 1.05).draft_tokens == 4  # served k=8: (1 + 8) // 2
    assert slope_probe(options, options[2], 1.05).draft_tokens == 2  # served k=3
    assert slope_probe(options, options[0], 1.05).draft_tokens == 8  # served k=1: the other end
    assert slope_probe(options[:1], options[0], 1.05) is None  # one k: no slope to measure


def test_plain_decoding_at_a_new_load_is_unconfirmed_there_unless_the_pool_is_far_ahead() -> None:
    """Plain was measured at c=1 (100 tokens); at c=4 one 21-token plain request is all there is. Plain is not
    cold (some bucket has min_rounds of it) and the speedup comes from c=1, where both were measured; but a
    gain measured at one load need not hold at another, so while the served pool is within 1/FAR of plain
    (1.25x here) plain is re-measured near c=4 at the cold rate, one request at a time. Not when the pool
    is far ahead (2.5x), nor once the bucket next to c=4 (c=2) has min_rounds plain tokens."""
    pv = policy().pool_pair_version("ngram")

    def snap(plain_c1_tpot: float, at_c2: bool = False):
        state = LearningState(policy().learning)
        state.record(plain_outcome(plain_c1_tpot))
        state.record(spec_outcome(pv, rounds=150))
        state.record(Outcome(route="default", slice="prose", pool="plain", completion_tokens=21, tpot_s=0.2,
                             concurrency=4))
        if at_c2:
            state.record(plain_outcome(0.1, concurrency=2))
        return state.snapshot(0.0, HEALTHY, 4)

    near = snap(0.05)
    assert near.plain_evidence("prose") == 100 and near.plain_nearby("prose") == 20
    d = decide(policy(cold=1.0), FEATURES, near, rng=random.Random(0))
    assert d.exploration == "unconfirmed" and d.bypass
    assert d.reason == "rule 'learned' auto: exploring unconfirmed plain decoding (20 tokens of evidence)"
    assert exploration_key(d) == "prose|none"
    d = decide(policy(cold=1.0), FEATURES, near, rng=random.Random(0), exploring={"prose|none"})
    assert not d.explored and (d.pool, d.draft_tokens) == ("ngram", 2)
    far = snap(0.1)  # 0.1 / (0.088 / 2.2) = 2.5x > 1 / FAR
    assert not decide(policy(cold=1.0), FEATURES, far, rng=random.Random(0)).explored
    measured_next_door = snap(0.05, at_c2=True)
    assert not decide(policy(cold=1.0), FEATURES, measured_next_door, rng=random.Random(0)).explored


def test_an_option_being_explored_is_not_explored_again_until_it_reports() -> None:
    """Nothing measured, explore_cold 1: the cold pool first; while it is in flight, cold plain; while both
    are, the request is served (cautious start) without starting a third exploration on the same evidence."""
    p = policy(cold=1.0)
    snap = LearningState(p.learning).snapshot(0.0, HEALTHY, 3)
    got = []
    for exploring in (set(), {"prose|ngram"}, {"prose|ngram", "prose|none"}):
        d = decide(p, FEATURES, snap, rng=random.Random(0), exploring=exploring)
        got.append((exploration_key(d), d.pool, d.bypass))
    assert got == [("prose|ngram", "ngram", False), ("prose|none", "plain", True), (None, "plain", True)]
    assert "cautious start" in decide(p, FEATURES, snap, rng=random.Random(0), exploring=got[0][:1] + got[1][:1]).reason


def test_a_pool_being_explored_is_not_explored_at_another_k_meanwhile() -> None:
    """ngram at k 1..2, nothing measured, explore_cold 1: the cold pool at its largest k first; while that
    request is in flight the pool's other k is not explored on the same evidence (cold plain is instead),
    and with both in flight nothing is."""
    p = load_policy(POLICY.replace("{min: 2, max: 2}", "{min: 1, max: 2}").replace("REV", "r1")
                    .replace("EXPLORE", "0.0").replace("GAIN", "1.05").replace("COLD", "1.0"), "t.yaml")
    snap = LearningState(p.learning).snapshot(0.0, HEALTHY, 3)
    first = decide(p, FEATURES, snap, rng=random.Random(0))
    assert (first.pool, first.draft_tokens, exploration_key(first)) == ("ngram", 2, "prose|ngram")
    second = decide(p, FEATURES, snap, rng=random.Random(0), exploring={exploration_key(first)})
    assert (second.bypass, exploration_key(second)) == (True, "prose|none")  # not ngram at k=1
    third = decide(p, FEATURES, snap, rng=random.Random(0), exploring={exploration_key(first), "prose|none"})
    assert not third.explored and "cautious start" in third.reason
