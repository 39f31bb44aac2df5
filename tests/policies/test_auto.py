"""auto's Thompson sampling (policies/auto.py) on scripted outcomes (CONTRIBUTING.md #7): the decision rule on synthetic
posteriors, and one regression test per flaw an earlier learner had (decay does not lower an unserved option's
estimate; a new load bucket is re-measured; costs per slice; the load bucket sees the workers' load)."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from policies.accept import counts_from_histogram, expected_tokens
from policies.auto import TAU_BAND, k_grid, option_note, posterior
from policies.decide import decide, explain
from policies.errors import PolicyError
from policies.features import RequestFeatures
from policies.load import load_policy
from policies.snapshot import PoolState, load_concurrency
from policies.stats import LearningState, Outcome
from speculation import SpeculationOverride
from tests.policies.auto_helpers import POLICY, PROSE, CODE, HEALTHY, policy, plain, spec, learned, share_speculating, noisy


def test_histogram_to_position_counts_and_expected_tokens() -> None:
    # rounds accepting 0, 1, 2 of k=2 drafts: 20, 40, 40
    assert counts_from_histogram([20, 40, 40], 2) == ([100, 80], [80, 40])
    assert expected_tokens([0.8, 0.5]) == [1.0, 1.8, 1.8 + 0.4]


def test_the_options_are_plain_and_each_pool_on_its_k_grid() -> None:
    text = POLICY.replace("REV", "r").replace("GAIN", "1.05").replace("{min: 2, max: 2}", "{min: 1, max: 12}")
    text = text.replace("pools:\n", "pools:\n  ad: {proposer: ngram, draft_tokens: 16, adaptive: true, pair: p, "
                        "workers: ['http://w:1'], speculation: per_request}\n")
    p = load_policy(text, "t.yaml")
    assert (k_grid(p, "ngram"), k_grid(p, "ad")) == ([1, 2, 4, 8, 12], [16])
    trace = explain(p, PROSE, LearningState(p.learning).snapshot(0.0, HEALTHY | {"ad": HEALTHY["ngram"]}, 1))
    assert [(c.pool, c.draft_tokens) for c in trace.candidates] == [
        ("", 0), ("ad", 16), ("ngram", 1), ("ngram", 2), ("ngram", 4), ("ngram", 8), ("ngram", 12)]


def test_a_fresh_learner_serves_every_option_once_then_draws() -> None:
    """Without evidence the means tie and min_gain keeps plain; with a random source each option is served
    once per slice first (plain, then the pools in order), one at a time per pool, then the draws decide."""
    p = policy()
    pv = p.pool_pair_version("ngram")
    state = LearningState(p.learning)
    d = decide(p, PROSE, state.snapshot(0.0, HEALTHY, 1))
    assert (d.bypass, d.pool, d.draft_tokens, d.exploration) == (True, "plain", 0, None)
    assert d.reason == "rule 'learned' auto: plain decoding"
    assert d.speculation_override == SpeculationOverride(proposer="none")
    first = decide(p, PROSE, state.snapshot(0.0, HEALTHY, 1), rng=random.Random(0))
    assert (first.bypass, first.exploration, first.reason) == (
        True, "cold", "rule 'learned' auto: exploring plain decoding (never measured here)")
    state.record(plain(0.05))
    snap = state.snapshot(0.0, HEALTHY, 1)
    second = decide(p, PROSE, snap, rng=random.Random(0))
    assert (second.pool, second.draft_tokens, second.exploration) == ("ngram", 2, "cold")
    assert second.reason.startswith("rule 'learned' auto: exploring pool 'ngram' k=2 (never measured here), ")
    # while that one is in flight the draws decide: n-gram has no data, plain one request
    busy = share_speculating(p, snap, exploring={"prose|ngram": 1})
    assert 0.0 < busy < 0.5
    state.record(spec(0.05, pv))
    assert decide(p, CODE, state.snapshot(0.0, HEALTHY, 1), rng=random.Random(0)).exploration == "cold"  # per slice
    assert 0.2 < share_speculating(p, state.snapshot(0.0, HEALTHY, 1)) < 0.6


def test_posterior_means_decide_without_a_random_source_and_min_gain_is_a_margin() -> None:
    p = policy()
    pv = p.pool_pair_version("ngram")
    rng = random.Random(1)
    state = learned(p, [o for _ in range(30) for o in (plain(noisy(rng, 0.05)), spec(noisy(rng, 0.04), pv))])
    snap = state.snapshot(0.0, HEALTHY, 1)
    trace = explain(p, PROSE, snap)
    by = {c.pool: c for c in trace.candidates}
    assert by[""].predicted_tpot_ms == pytest.approx(50.0, rel=0.05)
    assert by["ngram"].predicted_tpot_ms == pytest.approx(40.0, rel=0.05)
    assert by["ngram"].speedup == pytest.approx(1.25, rel=0.06) and by["ngram"].samples == pytest.approx(30.0)
    assert by["ngram"].p_best > 0.99 and by[""].p_best < 0.01
    d = trace.decision
    assert (d.bypass, d.pool, d.draft_tokens, d.exploration) == (False, "ngram", 2, None)
    assert d.predicted_speedup == pytest.approx(by["ngram"].speedup)
    # the decision (and so the response's specgate object) carries every option's posterior-mean TPOT
    assert d.posterior_tpot_ms == {option_note(c.pool, c.draft_tokens): pytest.approx(c.predicted_tpot_ms, abs=1e-3)
                                   for c in trace.candidates}
    assert set(d.posterior_tpot_ms) == {"plain decoding", *(f"ngram k={k}" for k in k_grid(p, "ngram"))}
    assert d.expected_accept_length == pytest.approx(101 / 50)
    assert d.speculation_override == SpeculationOverride(proposer="ngram", draft_tokens=2, adaptive=False)
    # min_gain is a margin on the draw: a 1.25x option loses to plain under min_gain 1.4
    assert decide(policy(gain=1.4), PROSE, snap).bypass
    assert share_speculating(p, snap) > 0.99 and share_speculating(policy(gain=1.4), snap) < 0.01


def test_close_options_are_both_served_and_evidence_concentrates_the_choice() -> None:
    """Thompson sampling serves each option with the posterior probability that it is best: 3% apart on 3
    requests each, both are served; on 60 each, the faster one almost always."""
    p = policy(gain=1.0)
    pv = p.pool_pair_version("ngram")
    shares = []
    for n in (1, 30):  # each side n requests at -10% and n at +10% of its mean: a spread of 0.1 in log TPOT
        state = learned(p, [o for _ in range(n) for e in (-0.1, 0.1)
                            for o in (plain(0.05 * math.exp(e)), spec(0.0485 * math.exp(e), pv))])
        shares.append(share_speculating(p, state.snapshot(0.0, HEALTHY, 1)))
    assert 0.5 < shares[0] < 0.75 and shares[1] > 0.9, shares


def test_decay_does_not_lower_an_unserved_options_estimate_but_widens_it() -> None:
    """Regression: the estimate of an unserved pool decayed toward a pessimistic prior, so the longer it was not
    served the worse it looked. Here its mean stays, its posterior widens, and it is re-tried more often."""
    p = policy(gain=1.0)
    pv = p.pool_pair_version("ngram")
    rng = random.Random(3)
    early = [spec(noisy(rng, 0.055), pv) for _ in range(20)]
    state = learned(p, early + [plain(noisy(rng, 0.05)) for _ in range(20)])
    before = state.snapshot(0.0, HEALTHY, 1)
    for t in range(1, 1001):  # ten half-lives of plain only
        state.record(plain(noisy(rng, 0.05), t=float(t)))
    after = state.snapshot(1000.0, HEALTHY, 1)
    b = posterior(before, "prose", 0, 0, f"ngram@2#{pv}")
    a = posterior(after, "prose", 0, 0, f"ngram@2#{pv}")
    assert a.mean == pytest.approx(b.mean, abs=0.01) and a.mean == pytest.approx(math.log(0.055), abs=0.03)
    assert a.var > 10 * b.var
    assert share_speculating(p, before) < 0.02 and share_speculating(p, after) > 0.1


def test_a_new_load_bucket_is_re_measured_and_then_decided_on_its_own_evidence() -> None:
    """Regression: plain was chosen at c1 (n-gram 10% slower there) and carried to loads where n-gram was 1.5-1.9x
    faster, with nothing re-exploring. Here a bucket never measured borrows the other buckets' estimates widened
    by TAU_LOAD, so n-gram is tried there; measured faster there, it serves there and not at c1."""
    p = policy()
    pv = p.pool_pair_version("ngram")
    rng = random.Random(4)
    c1 = [o for _ in range(40) for o in (plain(noisy(rng, 0.05)), spec(noisy(rng, 0.055), pv))]
    state = learned(p, c1)
    assert share_speculating(p, state.snapshot(0.0, HEALTHY, 1)) < 0.02
    new_load = share_speculating(p, state.snapshot(0.0, HEALTHY, 8))
    assert new_load > 0.15, new_load
    for _ in range(10):
        state.record(plain(noisy(rng, 0.12), concurrency=8))
        state.record(spec(noisy(rng, 0.07), pv, concurrency=8))
    assert not decide(p, PROSE, state.snapshot(0.0, HEALTHY, 8)).bypass
    assert decide(p, PROSE, state.snapshot(0.0, HEALTHY, 1)).bypass
    assert share_speculating(p, state.snapshot(0.0, HEALTHY, 8)) > 0.95


def test_estimates_are_per_slice() -> None:
    """Regression: a cost pooled across slices flipped long_context at c1. Each slice's options are its own."""
    p = policy()
    pv = p.pool_pair_version("ngram")
    rng = random.Random(5)
    state = learned(p, [o for _ in range(20) for o in (
        plain(noisy(rng, 0.05)), spec(noisy(rng, 0.06), pv),
        plain(noisy(rng, 0.05), slice_="code"), spec(noisy(rng, 0.03), pv, slice_="code"))])
    snap = state.snapshot(0.0, HEALTHY, 1)
    assert decide(p, PROSE, snap).bypass
    code = decide(p, CODE, snap)
    assert (code.slice, code.pool, code.predicted_speedup) == ("code", "ngram", pytest.approx(5 / 3, rel=0.08))


def test_an_option_that_slows_the_sequences_beside_it_pays_for_it() -> None:
    """The objective is engine-seconds per output token. At 8 in flight n-gram's own TPOT is 40 ms
    against plain's 50, but its drafts cost the 7 sequences beside it 15 ms a token (neighbour_tpot_s): charged
    55 ms, it loses to plain; the same speedup without that cost wins. Both ways of learning plain charge it
    (the option's own posterior and its gap to the worker's plain estimate)."""
    p = policy()
    pv = p.pool_pair_version("ngram")
    for paired in (False, True):
        for neighbour, speculates in ((0.015, False), (0.0, True)):
            rng = random.Random(7)
            outcomes = []
            for _ in range(30):
                o = spec(noisy(rng, 0.04), pv, concurrency=8, plain_tpot=noisy(rng, 0.05) if paired else None)
                outcomes += [msgspec.structs.replace(o, neighbour_tpot_s=neighbour)]
                if not paired:
                    outcomes.append(plain(noisy(rng, 0.05), concurrency=8))
            snap = learned(p, outcomes).snapshot(0.0, HEALTHY, 8)
            d = decide(p, PROSE, snap)
            assert d.bypass is not speculates, (paired, neighbour)
            charged = d.posterior_tpot_ms["ngram k=2"]
            assert charged == pytest.approx(40.0 + neighbour * 1e3, rel=0.06), (paired, neighbour)


SERVER_POOLS = """
version: 1
slices: [{name: prose}]
pairs:
  p: {target: {model: m, revision: r1}, draft: {kind: ngram}}
pools:
  plain: {proposer: none, workers: ["http://plain:1"]}
  ngram-k2: {proposer: ngram, draft_tokens: 2, pair: p, workers: ["http://k2:1"], speculation: server}
  ngram-k8: {proposer: ngram, draft_tokens: 8, pair: p, workers: ["http://k8:1"], speculation: server}
rules: [{name: learned, then: {pools: [ngram-k2, ngram-k8]}}]
learning: {half_life_s: 100, min_gain: 1.0}
"""


def test_among_sglang_server_pools_auto_chooses_the_pool_and_sends_no_k() -> None:
    """GPU pools fix k per server: the options are the pools themselves (each at its launch k), the choice is
    which pool, and the request carries no per-request speculation."""
    p = load_policy(SERVER_POOLS, "s.yaml")
    healthy = {name: PoolState(healthy=True, pair_verified=name != "plain" or None) for name in p.pools}
    assert [k_grid(p, name) for name in ("ngram-k2", "ngram-k8")] == [[2], [8]]
    rng = random.Random(8)

    def served(pool: str, k: int, tpot: float) -> Outcome:
        return Outcome(route="default", slice="prose", pool=pool, pair_version=p.pool_pair_version(pool),
                       proposer="ngram", draft_tokens=k, completion_tokens=101, verify_ct=40, tpot_s=tpot)

    state = learned(p, [o for _ in range(20) for o in (plain(noisy(rng, 0.05)), served("ngram-k2", 2, noisy(rng, 0.04)),
                                                        served("ngram-k8", 8, noisy(rng, 0.03)))])
    trace = explain(p, PROSE, state.snapshot(0.0, healthy, 1))
    d = trace.decision
    assert (d.pool, d.draft_tokens, d.bypass, d.speculation_override) == ("ngram-k8", 8, False, None)
    assert set(d.posterior_tpot_ms) == {"plain decoding", "ngram-k2 k=2", "ngram-k8 k=8"}
    assert d.predicted_speedup == pytest.approx(5 / 3, rel=0.08)
    assert d.posterior_tpot_ms["ngram-k2 k=2"] == pytest.approx(40.0, rel=0.06)


def test_prompt_repeat_bands_are_contexts_that_share_a_prior() -> None:
    """Acceptance is bimodal within a slice; prompt_repeat separates some of it. A band with its own evidence
    decides on it; a band without borrows the slice's other bands."""
    p = policy()
    pv = p.pool_pair_version("ngram")
    rng = random.Random(6)
    state = learned(p, [o for _ in range(20) for o in (
        plain(noisy(rng, 0.05), repeat=0.0), spec(noisy(rng, 0.07), pv, repeat=0.0),
        plain(noisy(rng, 0.05), repeat=0.3), spec(noisy(rng, 0.025), pv, repeat=0.3))])
    snap = state.snapshot(0.0, HEALTHY, 1)
    assert decide(p, RequestFeatures(max_tokens=9, prompt_repeat=0.01), snap).bypass
    high = decide(p, RequestFeatures(max_tokens=9, prompt_repeat=0.5), snap)
    assert not high.bypass and high.predicted_speedup == pytest.approx(2.0, rel=0.08)
    middle = explain(p, RequestFeatures(max_tokens=9, prompt_repeat=0.1), snap)  # band 1: never measured
    by = {c.pool: c for c in middle.candidates}
    assert by["ngram"].samples == 0 and 25 < by["ngram"].predicted_tpot_ms < 70 and by["ngram"].sd >= TAU_BAND


def test_explorations_in_flight_count_as_observations_at_the_current_mean() -> None:
    """A burst of arrivals on the same evidence does not all try the same barely measured option: n-gram measured
    once, 10% slower than plain, is drawn often alone and much less with six explorations of it in flight."""
    p = policy()
    pv = p.pool_pair_version("ngram")
    rng = random.Random(7)
    state = learned(p, [plain(noisy(rng, 0.05)) for _ in range(20)] + [spec(0.055, pv)])
    snap = state.snapshot(0.0, HEALTHY, 1)
    alone = share_speculating(p, snap)
    crowded = share_speculating(p, snap, exploring={"prose|ngram": 6})
    assert alone > 0.2 and crowded < alone / 2, (alone, crowded)
    assert share_speculating(p, snap, exploring={"code|ngram": 6}) == alone  # another slice's
    assert alone > share_speculating(p, snap, exploring=["prose|ngram"]) > crowded  # a plain collection: one each


def test_a_new_pair_version_is_a_new_option_and_its_old_evidence_is_forgotten() -> None:
    old, new = policy("r1"), policy("r2")
    assert old.pool_pair_version("ngram") != new.pool_pair_version("ngram")
    rng = random.Random(8)
    state = learned(old, [o for _ in range(20) for o in (plain(noisy(rng, 0.05)),
                                                          spec(noisy(rng, 0.03), old.pool_pair_version("ngram")))])
    snap = state.snapshot(0.0, HEALTHY, 1)
    assert not decide(old, PROSE, snap).bypass
    fresh = {c.pool: c for c in explain(new, PROSE, snap).candidates}["ngram"]
    assert fresh.samples == 0 and fresh.speedup == pytest.approx(1.0, abs=0.02)  # starts at plain's TPOT
    state.forget_pair_versions({new.pool_pair_version("ngram"), ""})
    data = state.snapshot(0.0, HEALTHY, 1).data
    assert data.acceptance == {} and sorted(data.arms) == ["prose|0|0|none"]


def test_the_spread_is_learned_per_option_from_its_requests() -> None:
    """Plain TPOT barely depends on the prompt; a speculative option's swings with acceptance. Each option's
    spread is its own, so plain's estimate is not made as uncertain as speculation's."""
    p = policy()
    pv = p.pool_pair_version("ngram")
    rng = random.Random(9)
    state = learned(p, [o for _ in range(200) for o in (
        plain(noisy(rng, 0.05)), spec(0.04 * math.exp(rng.gauss(0.0, 0.6)), pv))])
    snap = state.snapshot(0.0, HEALTHY, 1)
    assert snap.arm_spread("none", 0.09, 4.0) == pytest.approx(0.01, rel=0.35)
    assert snap.arm_spread(f"ngram@2#{pv}", 0.09, 4.0) == pytest.approx(0.36, rel=0.3)
    assert snap.arm_spread("never-served", 0.09, 4.0) == 0.09  # the prior
    by = {c.pool: c for c in explain(p, PROSE, snap).candidates}
    assert by[""].sd < by["ngram"].sd / 4


def test_failed_outcomes_are_counted_not_learned() -> None:
    state = LearningState(policy().learning)
    state.record(Outcome(route="default", slice="prose", pool="plain", ok=False, status=503))
    assert state.failures == 1 and state.snapshot(0.0, HEALTHY, 1).data.arms == {}


def test_the_load_bucket_counts_the_workers_load_not_only_this_gateways() -> None:
    """Regression: several gateways in front of one worker each see a share of its load; the workers'
    running + waiting (per worker of the busiest healthy pool) is the load a decision sees when it is more."""
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


def test_a_removed_learning_key_is_refused_with_the_fix() -> None:
    text = POLICY.replace("REV", "r").replace("min_gain: GAIN", "explore_cold: 0.5")
    with pytest.raises(PolicyError) as err:
        load_policy(text, "t.yaml")
    assert str(err.value) == ("t.yaml:10:30: learning.explore_cold: unknown key 'explore_cold'; removed: auto is "
                              "Thompson sampling over options per slice, load and prompt_repeat band, which needs no "
                              "exploration rates or evidence minimums (docs/policy.md, 'auto'); delete it")
