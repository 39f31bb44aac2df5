"""The pair gates in decisions: the built-in refusal of pending and failed pools, the ``pair_gate`` rule
condition, the serving gate's ramp (held requests are served plain), and the policy's ``gates:`` section."""

from __future__ import annotations

import random

import pytest

from policies.decide import decide, explain
from policies.errors import PolicyError
from policies.features import RequestFeatures
from policies.load import load_policy
from policies.snapshot import PoolState, Snapshot, SnapshotData

POLICY = """version: 1
slices:
  - {name: code, when: {code_score: {gte: 0.5}}}
  - {name: prose}
pairs:
  p: {target: {model: m}, draft: {kind: eagle3, model: d}}
pools:
  plain: {proposer: none, workers: ["http://a:1"]}
  eagle: {proposer: eagle3, draft_tokens: 3, pair: p, workers: ["http://b:1"]}
rules:
RULES
gates:
  equivalence: {max_canaries: 4, sampled: null}
  serving: {initial_share: 0.5, window: 4}
  outcome: null
"""
PIN = "  - {name: eagle, then: {pool: eagle, draft_tokens: 3}}\n"
OK = PoolState(healthy=True, pair_verified=True)
PROSE = RequestFeatures()


def policy(rules: str = PIN) -> object:
    return load_policy(POLICY.replace("RULES\n", rules), "p.yaml")


def snap(eagle: PoolState, concurrency: int = 1) -> Snapshot:
    return Snapshot(SnapshotData(pools={"plain": OK, "eagle": eagle}, concurrency=concurrency))


def gated(gate: str | None, **kw: object) -> PoolState:
    return PoolState(healthy=True, pair_verified=True, gate=gate, **kw)


# -- the built-in safety -------------------------------------------------------------------------------------

@pytest.mark.parametrize("gate, why", [("pending", "pair gate is pending (equivalence not yet passed)"),
                                       ("failed", "pair gate is failed")])
def test_pending_or_failed_pool_never_speculates(gate: str, why: str) -> None:
    d = decide(policy(), PROSE, snap(gated(gate)), rng=random.Random(0))
    assert (d.pool, d.bypass, d.draft_tokens, d.fallback, d.held_by_gate) == ("plain", True, 0, True, None)
    assert d.reason == f"rule 'eagle' chose pool 'eagle' but pool 'eagle' {why}; safety fallback without speculation"
    d = decide(policy("  - {name: learned, then: auto}\n"), PROSE, snap(gated(gate)), rng=random.Random(0))
    assert (d.pool, d.bypass, d.fallback) == ("plain", True, True)
    assert d.reason == f"rule 'learned' auto: no pool may speculate (pool 'eagle' {why})"


@pytest.mark.parametrize("gate", ["passed", "degraded", None])
def test_passed_degraded_and_ungated_pools_speculate(gate: str | None) -> None:
    d = decide(policy(), PROSE, snap(gated(gate)))
    assert (d.pool, d.bypass, d.draft_tokens, d.held_by_gate) == ("eagle", False, 3, None)


@pytest.mark.parametrize("cond", ["degraded", "[failed, degraded]"])
def test_pair_gate_rule_bypasses_a_degraded_pool(cond: str) -> None:
    p = policy("  - {name: no-degraded, when: {pair_gate: " + cond + "}, then: bypass}\n" + PIN)
    d = decide(p, PROSE, snap(gated("degraded")))
    assert (d.rule, d.pool, d.bypass, d.fallback) == ("no-degraded", "plain", True, False)
    label = "== degraded" if cond == "degraded" else "in [failed, degraded]"
    assert d.reason == f"rule 'no-degraded' (pair_gate {label}) bypasses speculation"
    for other in ("passed", None):  # a pool without a gate matches no state
        assert decide(p, PROSE, snap(gated(other))).rule == "eagle"
    rules = explain(p, PROSE, snap(gated("passed"))).rules
    assert (rules[0].matched, rules[0].failed) == (False, f"pair_gate {label}")


# -- the serving gate's ramp ---------------------------------------------------------------------------------

def test_half_share_holds_about_half_and_serves_them_plain() -> None:
    p, s = policy(), snap(gated("passed", ramp={"prose|0": 0.5, "code|0": 0.0}))
    rng = random.Random(28)
    decisions = [decide(p, PROSE, s, rng=rng) for _ in range(2000)]
    held = [d for d in decisions if d.held_by_gate is not None]
    assert 900 <= len(held) <= 1100, f"seed 28: {len(held)} of 2000 held at share 0.5"
    assert all((d.held_by_gate, d.pool, d.bypass, d.draft_tokens, d.rule) == ("eagle", "plain", True, 0, "eagle")
               for d in held)
    assert held[0].reason == ("rule 'eagle' (catch-all) pins pool 'eagle' with k=3; serving gate: pool 'eagle' is "
                              "ramping in slice prose, load bucket 0 at share 0.50; this request is its plain "
                              "comparison")
    served = [d for d in decisions if d.held_by_gate is None]
    assert all((d.pool, d.bypass, d.draft_tokens) == ("eagle", False, 3) for d in served)
    again = random.Random(28)  # same seed, same decisions
    assert [decide(p, PROSE, s, rng=again).held_by_gate for _ in range(2000)] == [d.held_by_gate for d in decisions]


def test_closed_region_always_holds_even_without_rng() -> None:
    p, s = policy(), snap(gated("degraded", ramp={"prose|2": 0.0}), concurrency=3)  # 3 in flight: bucket 2
    for rng in (None, random.Random(1)):
        for _ in range(50):
            d = decide(p, PROSE, s, rng=rng)
            assert (d.held_by_gate, d.pool, d.bypass) == ("eagle", "plain", True)
    assert d.reason.endswith("serving gate: pool 'eagle' is closed in slice prose, load bucket 2 (it missed the "
                             "serving gate's thresholds there)")
    d = decide(p, PROSE, snap(gated("degraded", ramp={"prose|2": 0.0}), concurrency=1))
    assert (d.held_by_gate, d.pool) == (None, "eagle")  # other load regions are not affected


def test_open_region_or_no_ramp_never_holds() -> None:
    p, rng = policy(), random.Random(5)
    for state in (gated("passed", ramp={"prose|0": 1.0}), gated("passed"), gated(None),
                  gated("passed", ramp={"code|0": 0.0, "prose|1": 0.0})):
        assert all(decide(p, PROSE, snap(state), rng=rng).held_by_gate is None for _ in range(200))


def test_ramp_default_applies_to_unlisted_regions() -> None:
    p = policy()
    s = snap(gated("passed", ramp={"prose|0": 1.0}, ramp_default=0.0))
    assert decide(p, PROSE, s).held_by_gate is None
    assert decide(p, RequestFeatures(code_score=0.9), s).held_by_gate == "eagle"  # code|0: the default


def test_ramp_without_rng_serves_a_ramping_region() -> None:
    d = decide(policy(), PROSE, snap(gated("passed", ramp={"prose|0": 0.25})))
    assert (d.held_by_gate, d.pool) == (None, "eagle")  # explanations do not draw


def test_a_bypass_rule_is_never_marked_held() -> None:
    p = policy("  - {name: rest, then: bypass}\n")
    d = decide(p, PROSE, snap(gated("passed", ramp={"prose|0": 0.0})))
    assert (d.rule, d.bypass, d.held_by_gate) == ("rest", True, None)


# -- the gates: section ---------------------------------------------------------------------------------------

def test_gates_section_loads_with_defaults() -> None:
    gates = policy().gates
    assert (gates.equivalence.max_canaries, gates.equivalence.sampled, gates.equivalence.timeout_s) == (4, None, 600.0)
    assert (gates.serving.initial_share, gates.serving.window, gates.serving.growth) == (0.5, 4, 2.0)
    assert gates.outcome is None and gates.collapse.floor == 1.05 and gates.collapse.min_baseline == 1.3
    without = load_policy(POLICY.replace("RULES\n", PIN).split("gates:")[0], "p.yaml")
    assert without.gates is None
    every = load_policy(POLICY.replace("RULES\n", PIN).split("gates:")[0] + "gates: {}\n", "p.yaml").gates
    assert every.serving.initial_share == 0.25 and every.outcome.min_reports == 20
    assert every.equivalence.sampled.alpha == 0.001


@pytest.mark.parametrize("old, new, expected", [
    ("initial_share: 0.5", "initial_share: 0",
     "p.yaml:14:28: gates.serving.initial_share: expected float > 0.0, got 0"),
    ("initial_share: 0.5", "growth: 1", "p.yaml:14:21: gates.serving.growth: expected float > 1.0, got 1"),
    ("window: 4", "windw: 4", "p.yaml:14:33: gates.serving.windw: unknown key 'windw'; did you mean 'window'?"),
    ("serving: {", "servng: {", "p.yaml:14:3: gates.servng: unknown key 'servng'; did you mean 'serving'?"),
    ("outcome: null", "outcome: {min_reports: 1}",
     "p.yaml:15:26: gates.outcome.min_reports: expected int >= 2, got 1"),
    ("sampled: null", "sampled: {alpha: 1.5}",
     "p.yaml:13:51: gates.equivalence.sampled.alpha: expected float < 1.0, got 1.5"),
    ("outcome: null", "collapse: {floor: 0.9}",
     "p.yaml:15:21: gates.collapse.floor: expected float >= 1.0, got 0.9"),
    ("eagle, then: {pool", "eagle, when: {pair_gate: degradd}, then: {pool",
     "p.yaml:11:37: rules[0] (Rule 'eagle').when.pair_gate: invalid value 'degradd'; expected one of: pending, "
     "passed, failed, degraded"),
    ("eagle, then: {pool", "eagle, when: {pair_gate: [failed, passd]}, then: {pool",
     "p.yaml:11:46: rules[0] (Rule 'eagle').when.pair_gate[1]: invalid value 'passd'; expected one of: pending, "
     "passed, failed, degraded"),
])
def test_gates_errors_name_the_field(old: str, new: str, expected: str) -> None:
    text = POLICY.replace("RULES\n", PIN)
    assert old in text
    with pytest.raises(PolicyError) as info:
        load_policy(text.replace(old, new), "p.yaml")
    assert info.value.errors == [expected]
