"""Scripted acceptance traces drive the learner and auto deterministically (STYLE #7)."""

from __future__ import annotations

import math
import random

from policies.accept import conditional_curve, counts_from_histogram, expected_tokens
from policies.auto import FAR_RATE
from policies.cost import FitSummary
from policies.decide import decide, explain
from policies.features import RequestFeatures
from policies.load import load_policy
from policies.snapshot import PoolState
from policies.stats import LearningState, Outcome

POLICY = """
version: 1
slices: [{name: prose}]
pairs:
  p: {target: {model: m, revision: REV}, draft: {kind: ngram}}
pools:
  plain: {proposer: none, workers: ["http://w:1"], speculation: per_request}
  ngram: {proposer: ngram, draft_tokens: {min: 2, max: 2}, pair: p, workers: ["http://w:1"], speculation: per_request}
rules: [{name: learned, then: auto}]
learning: {half_life_s: 100, min_rounds: 100, min_requests: 1, explore: EXPLORE, explore_cold: COLD, min_gain: GAIN,
           prior: {accept: 0.3, rounds: 0}}
"""
FEATURES = RequestFeatures(max_tokens=256)
HEALTHY = {"plain": PoolState(healthy=True), "ngram": PoolState(healthy=True, pair_verified=True)}


def policy(rev: str = "r1", explore: float = 0.0, gain: float = 1.05, cold: float = 0.0):
    text = POLICY.replace("REV", rev).replace("EXPLORE", str(explore)).replace("GAIN", repr(gain))
    return load_policy(text.replace("COLD", str(cold)), "t.yaml")


def plain_outcome(tpot: float, t: float = 0.0, concurrency: int = 1) -> Outcome:
    return Outcome(route="default", slice="prose", pool="plain", completion_tokens=101, tpot_s=tpot, timestamp=t,
                   concurrency=concurrency)


def spec_outcome(pv: str, rounds: int = 100, t: float = 0.0, tpot: float = 0.04, concurrency: int = 1) -> Outcome:
    """a_1 = 0.8, a_2 = 0.5 -> E[P](2) = 2.2; at tpot 0.04: 0.088 s per round."""
    reached, accepted = [rounds, rounds * 8 // 10], [rounds * 8 // 10, rounds * 4 // 10]
    return Outcome(route="default", slice="prose", pool="ngram", pair_version=pv, proposer="ngram",
                   draft_tokens=2, completion_tokens=1 + 22 * rounds // 10, verify_ct=rounds,
                   reached_per_position=reached, accepted_per_position=accepted, tpot_s=tpot, timestamp=t,
                   concurrency=concurrency)


def test_histogram_to_position_counts_and_curve() -> None:
    # rounds accepting 0, 1, 2 of k=2 drafts: 20, 40, 40
    reached, accepted = counts_from_histogram([20, 40, 40], 2)
    assert (reached, accepted) == ([100, 80], [80, 40])
    assert expected_tokens([0.8, 0.5]) == [1.0, 1.8, 1.8 + 0.4]
    assert conditional_curve(None, 0.3, 20.0, 3) == [0.3, 0.3, 0.3]


def test_cold_start_bypasses_with_reason() -> None:
    p = policy()
    d = decide(p, FEATURES, LearningState(p.learning).snapshot(0.0, HEALTHY, 1))
    assert d.bypass and d.pool == "plain" and d.draft_tokens == 0
    assert d.reason == ("rule 'learned' auto: no candidate has enough evidence yet (cautious start); "
                        "serving without speculation")
    assert d.speculation_override == {"proposer": "none"}


def test_min_rounds_boundary_is_inclusive() -> None:
    p = policy()
    pv = p.pool_pair_version("ngram")
    for rounds, speculates in ((99, False), (100, True)):
        state = LearningState(p.learning)
        state.record(plain_outcome(0.05))
        state.record(spec_outcome(pv, rounds=rounds))
        d = decide(p, FEATURES, state.snapshot(0.0, HEALTHY, 1))
        assert (not d.bypass) is speculates, (rounds, d.reason)


def test_min_gain_boundary_is_inclusive() -> None:
    state = LearningState(policy().learning)
    pv = policy().pool_pair_version("ngram")
    state.record(plain_outcome(0.05))
    state.record(spec_outcome(pv))
    snap = state.snapshot(0.0, HEALTHY, 1)
    cand = explain(policy(), FEATURES, snap).candidates[0]
    assert cand.expected_accept_length == 2.2
    assert math.isclose(cand.speedup, 0.05 / (0.088 / 2.2))  # 1.25x
    at = decide(policy(gain=cand.speedup), FEATURES, snap)
    above = decide(policy(gain=math.nextafter(cand.speedup, 2.0)), FEATURES, snap)
    assert not at.bypass and at.draft_tokens == 2 and at.speculation_override == {"proposer": "ngram",
                                                                                  "draft_tokens": 2,
                                                                                  "adaptive": False}
    assert above.bypass and "< min_gain" in above.reason


def test_a_speedup_is_capped_at_the_accept_length_that_bounds_it() -> None:
    """Plain timed while the engine was congested (0.2 s/token), the pool while it was not: 0.2 / (0.088 / 2.2)
    would predict 5x, but a round of E[P] = 2.2 tokens costs at least one plain step."""
    p = policy()
    state = LearningState(p.learning)
    state.record(plain_outcome(0.2))
    state.record(spec_outcome(p.pool_pair_version("ngram")))
    cand = explain(p, FEATURES, state.snapshot(0.0, HEALTHY, 1)).candidates[0]
    assert cand.expected_accept_length == 2.2 and cand.speedup == 2.2
    assert math.isclose(cand.predicted_tpot_ms, 40.0)  # the prediction itself is kept


def test_decay_halves_evidence_after_one_half_life_and_stale_candidates_are_re_measured() -> None:
    p = policy(explore=1.0)
    pv = p.pool_pair_version("ngram")
    state = LearningState(p.learning)
    state.record(plain_outcome(0.05))
    state.record(plain_outcome(0.05))
    state.record(spec_outcome(pv, rounds=150))
    assert not decide(p, FEATURES, state.snapshot(0.0, HEALTHY, 1)).bypass
    summary, factor = state.snapshot(100.0, HEALTHY, 1).acceptance("default", "prose", "ngram", pv, 100)
    assert factor == 0.5 and summary.curve_rounds * factor == 75.0 and summary.ever_curve_rounds == 150
    # one half-life later the decayed evidence (75 rounds) is below min_rounds 100: the estimate is kept
    # (ratios do not decay) and still exploited, but the pool is stale and exploration re-measures it
    later = explain(p, FEATURES, state.snapshot(100.0, HEALTHY, 1))
    assert later.candidates[0].eligible and later.candidates[0].stale and not later.candidates[0].cold
    assert not decide(p, FEATURES, state.snapshot(100.0, HEALTHY, 1)).bypass
    explored = decide(p, FEATURES, state.snapshot(100.0, HEALTHY, 1), rng=random.Random(0))
    assert explored.exploration == "stale"
    assert explored.reason == "rule 'learned' auto: exploring stale pool 'ngram' k=2 (75 rounds of evidence)"
    # two half-lives: both stale (plain 50 tokens, the pool 37.5 rounds); the least-sampled goes first
    assert "stale pool 'ngram'" in decide(p, FEATURES, state.snapshot(200.0, HEALTHY, 1), rng=random.Random(0)).reason


def test_pair_version_change_resets_statistics() -> None:
    old, new = policy("r1"), policy("r2")
    assert old.pool_pair_version("ngram") != new.pool_pair_version("ngram")
    state = LearningState(old.learning)
    state.record(plain_outcome(0.05))
    state.record(spec_outcome(old.pool_pair_version("ngram")))
    snap = state.snapshot(0.0, HEALTHY, 1)
    assert not decide(old, FEATURES, snap).bypass
    assert decide(new, FEATURES, snap).bypass  # the new version starts from nothing: cautious
    state.forget_pair_versions({new.pool_pair_version("ngram")})
    assert state.snapshot(0.0, HEALTHY, 1).data.acceptance == {}


def test_exploration_off_and_on_with_fixed_seed() -> None:
    """Warm statistics: ``explore`` is the rate; ``explore_cold`` does not apply."""
    off, on = policy(explore=0.0, cold=1.0), policy(explore=0.5, cold=1.0)
    state = LearningState(on.learning)
    state.record(plain_outcome(0.05))
    state.record(spec_outcome(on.pool_pair_version("ngram"), rounds=150))
    snap = state.snapshot(0.0, HEALTHY, 1)
    assert not any(decide(off, FEATURES, snap, rng=random.Random(3)).explored for _ in range(20))
    assert not any(decide(on, FEATURES, snap).explored for _ in range(20))  # no rng: never explores
    rng, mirror = random.Random(3), random.Random(3)
    got = [decide(on, FEATURES, snap, rng=rng) for _ in range(20)]
    assert [d.explored for d in got] == [mirror.random() < 0.5 for _ in range(20)]
    explored = [d for d in got if d.explored]
    assert explored and all((d.pool, d.draft_tokens, d.bypass) == ("ngram", 2, False) for d in explored)
    assert all(d.reason.startswith("rule 'learned' auto: exploring pool 'ngram'") for d in explored)
    assert {d.exploration for d in explored} == {"routine"}


def test_plain_decoding_is_re_measured_when_its_evidence_is_cold() -> None:
    """Once a pool is exploited nothing serves plain, so plain TPOT (every speedup's numerator) is
    re-measured when its evidence falls below min_rounds, at the cold rate; warm, it is not explored."""
    p = policy(cold=1.0)
    state = LearningState(p.learning)
    state.record(Outcome(route="default", slice="prose", pool="plain", completion_tokens=51, tpot_s=0.05))
    state.record(spec_outcome(p.pool_pair_version("ngram"), rounds=150))
    d = decide(p, FEATURES, state.snapshot(0.0, HEALTHY, 1), rng=random.Random(1))
    assert d.explored and d.bypass and d.pool == "plain" and d.speculation_override == {"proposer": "none"}
    assert d.reason == "rule 'learned' auto: exploring cold plain decoding (50 tokens of evidence)"
    assert d.exploration == "cold"
    state.record(plain_outcome(0.05))  # 150 plain tokens: warm, and no pool is cold -> no exploration
    assert not decide(p, FEATURES, state.snapshot(0.0, HEALTHY, 1), rng=random.Random(1)).explored


def test_cold_candidates_are_explored_at_the_cold_rate() -> None:
    """No evidence: ``explore_cold`` is the rate (``explore`` does not apply); the rest bypass."""
    cold, warm_only = policy(explore=0.0, cold=0.5), policy(explore=0.5, cold=0.0)
    snap = LearningState(cold.learning).snapshot(0.0, HEALTHY, 1)
    assert not any(decide(warm_only, FEATURES, snap, rng=random.Random(3)).explored for _ in range(20))
    rng, mirror = random.Random(3), random.Random(3)
    got = [decide(cold, FEATURES, snap, rng=rng) for _ in range(20)]
    assert [d.explored for d in got] == [mirror.random() < 0.5 for _ in range(20)]
    assert all((d.pool, d.draft_tokens) == ("ngram", 2) and "exploring cold pool 'ngram'" in d.reason
               for d in got if d.explored)
    assert all(d.bypass and "cautious start" in d.reason for d in got if not d.explored)


def test_a_bucket_pairs_plain_with_a_pool_only_once_both_were_measured_there() -> None:
    """At concurrency 4 plain was measured (0.2 s) but the pool ran one short request (10 rounds at
    0.02 s/round): pairing those would predict 0.2 / (0.02 / 2.2) = 22x. Until the pool has min_rounds
    rounds in that bucket, both times come from the nearest bucket where both were measured (c=1)."""
    p = policy()
    pv = p.pool_pair_version("ngram")
    state = LearningState(p.learning)
    state.record(plain_outcome(0.05))
    state.record(spec_outcome(pv, rounds=150))  # c=1: 0.088 s per round -> 1.25x
    state.record(plain_outcome(0.2, concurrency=4))
    state.record(spec_outcome(pv, rounds=10, tpot=0.02 * 10 / 22, concurrency=4))
    speedup = explain(p, FEATURES, state.snapshot(0.0, HEALTHY, 4)).candidates[0].speedup
    assert math.isclose(speedup, 0.05 / (0.088 / 2.2))
    state.record(spec_outcome(pv, rounds=90, tpot=0.02 * 10 / 22, concurrency=4))  # 100 rounds at c=4
    cand = explain(p, FEATURES, state.snapshot(0.0, HEALTHY, 4)).candidates[0]
    # now both times are c=4's: 0.2 / (0.02 / 2.2) = 22x, capped at the accept length that bounds it
    assert math.isclose(cand.predicted_tpot_ms, 1e3 * 0.02 / 2.2) and cand.speedup == 2.2


def test_a_stale_pool_far_behind_is_re_measured_a_tenth_as_often() -> None:
    """Exploring draws below explore * FAR_RATE may re-measure a stale pool predicted below FAR x the
    served speed; the others serve the best pool at its largest k instead."""
    text = POLICY.replace("pools:\n", "pools:\n  slow: {proposer: ngram, draft_tokens: {min: 2, max: 2}, pair: p, "
                          "workers: [\"http://w:1\"], speculation: per_request}\n")
    p = load_policy(text.replace("REV", "r1").replace("EXPLORE", "1.0").replace("GAIN", "1.05")
                    .replace("COLD", "0.0"), "t.yaml")
    pv = p.pool_pair_version("ngram")
    healthy = {**HEALTHY, "slow": PoolState(healthy=True, pair_verified=True)}
    state = LearningState(p.learning)
    state.record(Outcome(route="default", slice="prose", pool="slow", pair_version=pv, proposer="ngram",
                         draft_tokens=2, completion_tokens=201, verify_ct=100, tpot_s=0.2, timestamp=0.0))
    state.record(plain_outcome(0.05, t=200.0))
    state.record(spec_outcome(pv, rounds=150, t=200.0))
    snap = state.snapshot(200.0, healthy, 1)
    slow = next(c for c in explain(p, FEATURES, snap).candidates if c.pool == "slow")
    assert slow.stale and math.isclose(slow.speedup, 0.25)  # two half-lives: 25 rounds < min_rounds 100
    rng, mirror = random.Random(5), random.Random(5)
    got = [decide(p, FEATURES, snap, rng=rng).pool for _ in range(200)]
    expected = ["slow" if mirror.random() < 1.0 * FAR_RATE else "ngram" for _ in range(200)]
    assert got == expected and 0 < got.count("slow") < 40


def test_a_pool_near_plain_on_few_requests_is_explored_until_confirmed() -> None:
    """Three requests put the pool at 0.95x (plain is served): that may be three unlucky prompts, so it is
    explored at the cold rate until it has confirm_requests (8); a pool far behind (0.4x) is not."""
    p = policy(cold=1.0)
    pv = p.pool_pair_version("ngram")
    state = LearningState(p.learning)
    state.record(plain_outcome(0.038))
    for _ in range(3):
        state.record(spec_outcome(pv, rounds=50))
    snap = state.snapshot(0.0, HEALTHY, 1)
    cand = explain(p, FEATURES, snap).candidates[0]
    assert cand.unconfirmed and not cand.cold and math.isclose(cand.speedup, 0.95)
    d = decide(p, FEATURES, snap, rng=random.Random(0))
    assert d.explored and (d.pool, d.draft_tokens, d.bypass) == ("ngram", 2, False)
    assert d.reason == "rule 'learned' auto: exploring unconfirmed pool 'ngram' k=2 (150 rounds of evidence)"
    for _ in range(5):
        state.record(spec_outcome(pv, rounds=50))
    d = decide(p, FEATURES, state.snapshot(0.0, HEALTHY, 1), rng=random.Random(0))
    assert not d.explored and d.bypass and "speedup 0.95x < min_gain" in d.reason
    far = LearningState(p.learning)
    far.record(plain_outcome(0.016))
    for _ in range(3):
        far.record(spec_outcome(pv, rounds=50))
    d = decide(p, FEATURES, far.snapshot(0.0, HEALTHY, 1), rng=random.Random(0))
    assert not d.explored and d.bypass and "speedup 0.40x < min_gain" in d.reason


def test_one_measured_k_predicts_no_cheaper_shorter_drafts_and_is_probed_at_the_smallest_k() -> None:
    fit = FitSummary(t_ref=0.0, w=100.0, sk=800.0, skk=6400.0, sy=8.0, sky=64.0)  # k=8 only, 0.08 s/round
    assert not fit.identified
    line = fit.round_time(0.1)
    assert line.predict(1) == line.predict(8) == 0.08 and line.predict(9) > 0.08
    p = load_policy(POLICY.replace("{min: 2, max: 2}", "{min: 1, max: 2}").replace("REV", "r1")
                    .replace("EXPLORE", "0.0").replace("GAIN", "1.05").replace("COLD", "1.0"), "t.yaml")
    pv = p.pool_pair_version("ngram")
    state = LearningState(p.learning)
    state.record(plain_outcome(0.05))
    for _ in range(8):
        state.record(spec_outcome(pv, rounds=50))  # k=2 only: 1.25x, served
    d = decide(p, FEATURES, state.snapshot(0.0, HEALTHY, 1), rng=random.Random(0))
    assert d.explored and d.draft_tokens == 1
    assert d.reason == "rule 'learned' auto: exploring the cost slope of pool 'ngram' k=1 (400 rounds of evidence)"
    k1 = Outcome(route="default", slice="prose", pool="ngram", pair_version=pv, proposer="ngram", draft_tokens=1,
                 completion_tokens=91, verify_ct=50, reached_per_position=[50], accepted_per_position=[40],
                 tpot_s=0.02, timestamp=0.0)  # 0.036 s per k=1 round: a steep slope if trusted
    state.record(k1)
    snap = state.snapshot(0.0, HEALTHY, 1)
    fit = snap.data.rounds["ngram|0"]
    assert fit.identified and not fit.slope_measured(100) and fit.slope_measured(50)
    k1_cand = explain(p, FEATURES, snap).candidates[0]
    assert k1_cand.draft_tokens == 1 and k1_cand.slope_unknown
    assert math.isclose(k1_cand.predicted_tpot_ms, fit.sy / fit.w / 1.8 * 1e3)  # the measured mean, no saving
    d = decide(p, FEATURES, snap, rng=random.Random(0))
    assert d.explored and d.draft_tokens == 1  # 50 rounds at k=1 < min_rounds 100: one request's timing
    state.record(k1)
    d = decide(p, FEATURES, state.snapshot(0.0, HEALTHY, 1), rng=random.Random(0))
    assert not d.explored and not d.bypass and d.draft_tokens == 1  # min_rounds at two k: the fitted slope


def test_totals_only_outcomes_use_measured_tpot() -> None:
    p = policy()
    pv = p.pool_pair_version("ngram")
    state = LearningState(p.learning)
    state.record(plain_outcome(0.05))
    state.record(Outcome(route="default", slice="prose", pool="ngram", pair_version=pv, proposer="ngram",
                         draft_tokens=2, completion_tokens=201, verify_ct=100, tpot_s=0.025))
    cand = explain(p, FEATURES, state.snapshot(0.0, HEALTHY, 1)).candidates[0]
    assert cand.note == "measured TPOT (per-request totals only)"
    assert cand.expected_accept_length == 2.01 and math.isclose(cand.speedup, 2.0)


def test_an_adaptive_pool_is_one_option_judged_by_measured_tpot_and_tells_the_worker() -> None:
    """Its k varies per round and prompt: even with per-position data, auto neither models it from the curve
    nor offers shorter k; it serves the pool's largest k with ``adaptive: true``."""
    text = POLICY.replace("REV", "r1").replace("EXPLORE", "0").replace("GAIN", "1.05").replace("COLD", "0")
    p = load_policy(text.replace("draft_tokens: {min: 2, max: 2}, pair: p",
                                 "draft_tokens: 2, adaptive: true, pair: p"), "t.yaml")
    state = LearningState(p.learning)
    state.record(plain_outcome(0.05))
    state.record(spec_outcome(p.pool_pair_version("ngram"), tpot=0.03))  # curve says E[P](2) = 2.2
    snap = state.snapshot(0.0, HEALTHY, 1)
    (cand,) = explain(p, FEATURES, snap).candidates
    assert cand.note == "measured TPOT (the worker picks k per sequence, up to this one)"
    assert cand.draft_tokens == 2 and math.isclose(cand.speedup, 0.05 / 0.03)
    d = decide(p, FEATURES, snap)
    assert not d.bypass and d.speculation_override == {"proposer": "ngram", "draft_tokens": 2, "adaptive": True,
                                                       "strategy": "beta"}


def test_failed_outcomes_are_counted_not_learned() -> None:
    state = LearningState(policy().learning)
    state.record(Outcome(route="default", slice="prose", pool="plain", ok=False, status=503))
    assert state.failures == 1 and state.snapshot(0.0, HEALTHY, 1).data.tpot == {}

