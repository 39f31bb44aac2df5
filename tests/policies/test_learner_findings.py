"""The learner's fixes for issue 26's findings, each a test that fails without its fix (scripted outcomes,
STYLE #7): decay does not lower an unserved pool's estimate, round time per slice, a new load re-measures
a pool, and the load bucket sees the workers' load."""

from __future__ import annotations

import random

import pytest

from policies.accept import conditional_curve
from policies.decide import decide
from policies.features import RequestFeatures
from policies.load import load_policy
from policies.snapshot import PoolState
from policies.stats import LearningState, Outcome
from tests.policies.test_learner import FEATURES, HEALTHY, POLICY, plain_outcome, policy, spec_outcome



def test_decay_does_not_lower_an_unserved_pools_estimate() -> None:
    """Issue 26: the acceptance estimate of a pool that is not served stays where its evidence put it
    (only the amount of evidence decays, which marks it stale); it used to slide to the cautious prior."""
    p = policy()
    pv = p.pool_pair_version("ngram")
    state = LearningState(p.learning)
    state.record(plain_outcome(0.05))
    state.record(spec_outcome(pv, rounds=400))
    half_life = p.learning.half_life_s
    early = state.snapshot(1.0, HEALTHY, 1)
    late = state.snapshot(20 * half_life, HEALTHY, 1)
    summary, f = late.acceptance("default", "prose", "ngram", pv, p.learning.min_rounds)
    assert f < 1e-5  # twenty half-lives later the evidence is all but gone...
    curve_early = conditional_curve(early.acceptance("default", "prose", "ngram", pv, 64)[0], 0.3, 20.0, 2)
    curve_late = conditional_curve(summary, 0.3, 20.0, 2)
    assert curve_late == curve_early  # ...but the estimate is the same
    assert curve_late[0] == pytest.approx((320 + 0.3 * 20) / (400 + 20))


def test_round_time_is_fitted_per_slice_where_the_slice_has_its_own() -> None:
    """Issue 26: plain TPOT is per slice, so the round time it is divided by must be too. Two slices whose
    contexts make every forward 2x slower in one: pooled, the long slice's speculation looked cheaper than it
    is and the short one's dearer; per slice, each speedup is its own plain TPOT over its own round time."""
    text = POLICY.replace("slices: [{name: prose}]",
                          "slices: [{name: long, when: {prompt_tokens: {gte: 512}}}, {name: prose}]")
    p = load_policy(text.replace("REV", "r1").replace("EXPLORE", "0.0").replace("GAIN", "1.05")
                    .replace("COLD", "0.0"), "t.yaml")
    pv = p.pool_pair_version("ngram")
    state = LearningState(p.learning)
    for slice_, scale in (("prose", 1.0), ("long", 2.0)):
        state.record(Outcome(route="default", slice=slice_, pool="plain", completion_tokens=201,
                             tpot_s=0.040 * scale, timestamp=0.0))
        # 100 rounds of k=2 committing 2.2 tokens each (a_1 0.8, a_2 0.5): 220 tokens, 0.066 s per round
        state.record(Outcome(route="default", slice=slice_, pool="ngram", pair_version=pv, proposer="ngram",
                             draft_tokens=2, completion_tokens=221, verify_ct=100, reached_per_position=[100, 80],
                             accepted_per_position=[80, 40], tpot_s=0.066 * scale * 100 / 220, timestamp=0.0))
    snap = state.snapshot(0.0, HEALTHY, 1)
    for slice_, prompt in (("prose", 10), ("long", 2000)):
        d = decide(p, RequestFeatures(max_tokens=256, prompt_tokens=prompt), snap)
        assert (d.slice, d.bypass) == (slice_, False)
        assert d.predicted_speedup == pytest.approx(0.040 / (0.066 / 2.2))  # the same in both slices
        assert d.expected_accept_length == pytest.approx(2.2)  # 1 + 0.8 + 0.8 * 0.5


def test_a_new_load_re_measures_a_pool_that_lost_at_another_load() -> None:
    """Issue 26: measured at c1, where n-gram lost to plain (1.0x < min_gain), n-gram was never tried again
    when the load rose, though its gain changes with load (1.5-1.9x under Poisson load in the full run).
    At a load more than a factor of two from where the pool was measured, it is explored at the cold rate
    until measured there; at the load it was measured at, it is not."""
    p = policy(cold=0.5)
    pv = p.pool_pair_version("ngram")
    state = LearningState(p.learning)
    for i in range(10):  # confirmed at c1: 0.088 s per round / 2.2 tokens = 0.04 s per token, plain 0.04
        state.record(plain_outcome(0.04, t=i))
        state.record(spec_outcome(pv, rounds=100, t=i, tpot=0.04))

    def ngram_explorations(concurrency: int) -> list:
        snap = state.snapshot(10.0, HEALTHY, concurrency)
        rng = random.Random(0)
        picks = [decide(p, FEATURES, snap, rng=rng) for _ in range(200)]
        return [d for d in picks if d.pool == "ngram"]

    assert ngram_explorations(1) == []
    at_c8 = ngram_explorations(8)
    assert 50 < len(at_c8) < 150 and {d.exploration for d in at_c8} == {"unconfirmed"}


def test_the_load_bucket_counts_the_workers_load_not_only_this_gateways() -> None:
    """Issue 26: several gateways in front of one worker each see a share of its load; the workers'
    running + waiting (per worker of the busiest healthy pool) is the load a decision sees when it is more."""
    from policies.snapshot import load_concurrency

    one = {"plain": PoolState(healthy=True, running=3, waiting=0, workers_healthy=1)}
    assert load_concurrency(3, one) == 4  # this gateway's 3 in flight are the worker's 3: both say 4
    busy = {"plain": PoolState(healthy=True, running=8, waiting=4, workers_healthy=1),
            "ngram": PoolState(healthy=True, running=20, waiting=4, workers_healthy=3),  # 8 per worker
            "down": PoolState(healthy=False, running=99, waiting=0, workers_healthy=0)}
    assert load_concurrency(1, busy) == 13  # other gateways' traffic: 12 on the plain worker, + this request
    assert load_concurrency(20, busy) == 21
    assert load_concurrency(0, {}) == 1
    p = policy()
    snap = LearningState(p.learning).snapshot(0.0, busy, load_concurrency(1, busy))
    assert snap.bucket() == 4  # edges 1, 2, 4, 8, 16: 13 falls in the bucket up to 16
