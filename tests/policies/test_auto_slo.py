"""A TPOT SLO steers ``auto`` (policies/auto.py, "SLO"): the cheapest option among those likeliest to meet it.

The learner below has seen plain decoding at 30 ms a token, every prompt alike, and an n-gram pool at 16 or 44 ms
(26.5 ms geometric mean, a wide spread: drafts hit or miss by prompt). By cost alone the pool serves; a request
that needs 32 ms a token meets it with plain far more often, so plain serves it."""

from __future__ import annotations

import math
import random

import pytest

from policies.auto import SLO_SLACK, slo_chance
from policies.decide import decide, explain, steering_slo_ms
from policies.errors import PolicyError
from policies.features import RequestFeatures
from policies.load import load_policy
from tests.policies.auto_helpers import HEALTHY, POLICY, learned, plain, spec


def policy(mode: str = "stated", route_ms: float = 500.0):
    text = POLICY.replace("REV", "r1").replace("min_gain: GAIN", f"min_gain: 1.05, slo_objective: {mode}")
    return load_policy(f"slo: {{tpot_ms: {route_ms!r}}}" + text, "t.yaml")


def snapshot(p):
    """60 requests each: plain at 29.5 / 30.5 ms, the n-gram pool at 16 / 44 ms."""
    pv = p.pool_pair_version("ngram")
    return learned(p, [o for i in range(60) for o in (plain((0.0295, 0.0305)[i % 2]),
                                                       spec((0.016, 0.044)[i % 2], pv))]).snapshot(0.0, HEALTHY, 1)


def request(slo_ms: float | None, stated: bool) -> RequestFeatures:
    return RequestFeatures(max_tokens=256, slo_tpot_ms=slo_ms, slo_tpot_stated=stated)


def test_a_stated_tight_tpot_slo_moves_the_request_to_the_option_likeliest_to_meet_it() -> None:
    p = policy()
    snap = snapshot(p)
    assert decide(p, request(None, False), snap).pool == "ngram"  # cost alone: 26.5 ms against plain's 30 / 1.05
    tight = explain(p, request(32.0, True), snap)
    by = {c.pool: c for c in tight.candidates}
    # plain's 30 ms barely spreads; the pool's 16-or-44 ms does
    assert 0.75 < by[""].slo_chance < 0.85 and 0.6 < by["ngram"].slo_chance < 0.7
    # P(TPOT <= 32 ms) for log TPOT ~ Normal(the posterior mean, the option's spread between requests)
    spread = math.sqrt(snap.arm_spread("none", 0.09, 4.0))  # auto's prior on the spread: 0.3 worth 4 requests
    assert by[""].slo_chance == pytest.approx(slo_chance(math.log(by[""].predicted_tpot_ms / 1e3), spread,
                                                         math.log(0.032)), abs=1e-9)
    d = tight.decision
    assert (d.pool, d.bypass) == ("plain", True)
    assert d.reason == f"rule 'learned' auto: plain decoding (TPOT SLO 32 ms: met with p={by[''].slo_chance:.2f})"
    # a loose SLO every option meets leaves the cost ranking
    loose = explain(p, request(200.0, True), snap)
    assert loose.decision.pool == "ngram"
    assert all(c.slo_chance > 1 - SLO_SLACK for c in loose.candidates)
    assert "(TPOT SLO 200 ms: met with p=" in loose.decision.reason


def test_thompson_draws_serve_the_tight_slo_mostly_with_plain() -> None:
    p = policy()
    snap = snapshot(p)
    rng = random.Random(5)
    shares = [sum(decide(p, request(slo, stated), snap, rng=rng).bypass for _ in range(400)) / 400
              for slo, stated in ((None, False), (32.0, True))]
    assert shares[0] < 0.2 and shares[1] > 0.9, shares


@pytest.mark.parametrize(("mode", "stated", "steers"), [
    ("stated", False, False),  # the route's SLO: goodput only, by default
    ("stated", True, True),
    ("in_force", False, True),  # the route's SLO steers too
    ("none", True, False),
])
def test_slo_objective_says_which_slo_steers(mode: str, stated: bool, steers: bool) -> None:
    p = policy(mode, route_ms=32.0)
    features = request(32.0, stated)
    assert steering_slo_ms(p, features) == (32.0 if steers else None)
    assert decide(p, features, snapshot(p)).pool == ("plain" if steers else "ngram")


def test_a_bad_slo_objective_is_refused_naming_the_key() -> None:
    with pytest.raises(PolicyError) as caught:
        policy("sometimes")
    assert "slo_objective" in str(caught.value)
