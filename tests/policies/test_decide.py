"""Slicing, rules, safety fallback, determinism and the default policy."""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.decide import decide
from policies.features import (RequestFeatures, approx_tokens, code_score, features_from_openai, prompt_repeat,
                               referenced_headers)
from policies.load import load_policy, load_policy_file
from policies.slicing import classify
from policies.snapshot import PoolState, Snapshot, SnapshotData
from speculation import SpeculationOverride

DEFAULT = Path(__file__).resolve().parents[2] / "deploy" / "policies" / "default.yaml"
OK = PoolState(healthy=True, pair_verified=True)

PINNED = """
version: 1
slo: {ttft_ms: 2000, tpot_ms: 120}
routes:
  - {name: ide, api_keys_env: KEYS_IDE, slo: {tpot_ms: 60}}
  - {name: batch}
slices:
  - {name: canary, when: {headers: {X-Canary: ["1", "yes"]}}}
  - {name: code, when: {code_score: {gte: 0.5}, route: ide}}
  - {name: prose}
pairs:
  p: {target: {model: m}, draft: {kind: eagle3, model: d}}
pools:
  plain: {proposer: none, workers: ["http://a:1"]}
  eagle: {proposer: eagle3, draft_tokens: 3, pair: p, workers: ["http://b:1"]}
rules:
  - {name: busy, when: {concurrency: {gte: 32}}, then: bypass}
  - {name: code-eagle, when: {slice: code}, then: {pool: eagle, draft_tokens: 3}}
  - {name: rest, then: bypass}
"""


def snap(pools: dict[str, PoolState], concurrency: int = 1) -> Snapshot:
    return Snapshot(SnapshotData(pools=pools, concurrency=concurrency))


def test_default_policy_loads_and_slices() -> None:
    p = load_policy_file(DEFAULT)
    assert list(p.pools) == ["plain", "ngram", "ngram-adaptive", "hybrid", "draft"] and p.default_route == "default" and not p.auth_enabled
    assert p.pairs["smollm2-self8"].draft.layers == 8
    assert classify(p, RequestFeatures(has_tools=True)) == ("tool_call", 0)
    assert classify(p, RequestFeatures(response_format="json_schema")) == ("tool_call", 1)
    assert classify(p, RequestFeatures(prompt_tokens=512)) == ("long_context", 2)
    assert classify(p, RequestFeatures(prompt_tokens=511, code_score=0.3)) == ("code", 3)
    assert classify(p, RequestFeatures(code_score=0.29)) == ("prose", 4)
    d = decide(p, RequestFeatures(max_tokens=7), snap({n: OK for n in p.pools}))
    assert (d.rule, d.bypass) == ("tiny-budget", True)
    d = decide(p, RequestFeatures(max_tokens=64), snap({**{n: OK for n in p.pools},
                                                        "draft": PoolState(healthy=True, pair_verified=False)}))
    assert (d.rule, d.pool, d.bypass) == ("unverified-pair", "plain", True)
    d = decide(p, RequestFeatures(max_tokens=64), snap({**{n: OK for n in p.pools},
                                                        "ngram": PoolState(healthy=True, pair_verified=True,
                                                                           kv_usage=0.95)}))
    assert d.rule == "kv-pressure"


def test_routes_slo_and_headers() -> None:
    p = load_policy(PINNED, "p.yaml")
    assert p.route_slo("ide").tpot_ms == 60 and p.route_slo("ide").ttft_ms == 2000
    assert p.route_slo("batch").tpot_ms == 120 and p.default_route == "batch" and p.auth_enabled
    assert referenced_headers(p) == {"x-canary"}
    assert classify(p, RequestFeatures(headers={"x-canary": "yes"})) == ("canary", 0)
    assert classify(p, RequestFeatures(route="batch", code_score=0.9)) == ("prose", 2)


def test_pinned_pool_and_safety_fallback() -> None:
    p = load_policy(PINNED, "p.yaml")
    f = RequestFeatures(route="ide", code_score=0.9)
    d = decide(p, f, snap({"plain": OK, "eagle": OK}))
    assert (d.pool, d.proposer, d.draft_tokens, d.bypass, d.fallback) == ("eagle", "eagle3", 3, False, False)
    assert d.speculation_override is None  # a server pool: k is fixed by the server
    for bad in (PoolState(healthy=False, pair_verified=True), PoolState(healthy=True, pair_verified=None),
                PoolState(healthy=True, pair_verified=False)):
        d = decide(p, f, snap({"plain": OK, "eagle": bad}))
        assert (d.pool, d.bypass, d.fallback, d.draft_tokens) == ("plain", True, True, 0), d.reason
    d = decide(p, f, snap({"plain": OK, "eagle": OK}, concurrency=40))
    assert (d.rule, d.bypass) == ("busy", True)


def test_fallback_without_plain_pool_uses_same_workers_without_speculation() -> None:
    text = """
version: 1
slices: [{name: prose}]
pairs: {p: {target: {model: m}, draft: {kind: ngram}}}
pools:
  ngram: {proposer: ngram, draft_tokens: 4, pair: p, workers: ["http://a:1"], speculation: per_request}
rules: [{name: always, then: {pool: ngram, draft_tokens: 4}}]
"""
    p = load_policy(text, "p.yaml")
    d = decide(p, RequestFeatures(), snap({"ngram": PoolState(healthy=True, pair_verified=False)}))
    assert (d.pool, d.bypass, d.fallback) == ("ngram", True, True)
    assert d.speculation_override == SpeculationOverride(proposer="none")
    assert d.reason == ("rule 'always' chose pool 'ngram' but pool 'ngram' pair is mismatched; safety "
                        "fallback without speculation")


def test_feature_estimators() -> None:
    assert approx_tokens("") == 0 and approx_tokens("a" * 36) == 10
    prose = "The committee met on Tuesday to discuss the budget. Several members raised concerns."
    code = "```python\ndef add(a, b):\n    if a is None:\n        return b\n    return a + b\n```"
    assert code_score(prose) < 0.2 and code_score(code) > 0.7
    f = features_from_openai({"model": "m", "messages": [{"role": "user", "content": code}], "tools": [{}],
                              "response_format": {"type": "json_object"}, "max_tokens": 9},
                             route="ide", headers={"X-Canary": "1", "Other": "x"}, wanted_headers={"x-canary"})
    assert (f.has_tools, f.response_format, f.max_tokens, f.headers) == (True, "json_object", 9, {"x-canary": "1"})
    assert (f.code_score, f.prompt_repeat) == (code_score(code), prompt_repeat(code)) and prompt_repeat(prose) == 0.0


@settings(max_examples=150, deadline=None)
@given(code=st.floats(0, 1), prompt=st.integers(0, 9000), max_tokens=st.one_of(st.none(), st.integers(1, 512)),
       healthy=st.booleans(), verified=st.sampled_from([True, False, None]), kv=st.floats(0, 1),
       seed=st.integers(0, 2**16))
def test_decisions_are_deterministic_and_safe(code, prompt, max_tokens, healthy, verified, kv, seed) -> None:
    p = load_policy_file(DEFAULT)
    state = PoolState(healthy=healthy, pair_verified=verified, kv_usage=kv)
    s = snap({"plain": OK, "ngram": state, "draft": state})
    f = RequestFeatures(code_score=code, prompt_tokens=prompt, max_tokens=max_tokens)
    a = decide(p, f, s, rng=random.Random(seed))
    assert a == decide(p, f, s, rng=random.Random(seed))
    assert a.bypass == (a.draft_tokens == 0) == (a.proposer == "none")
    if not a.bypass:
        assert healthy and verified is True
        lo, hi = p.pools[a.pool].k_range
        assert lo <= a.draft_tokens <= hi
