"""The suffix proposer's scope: every attempt the gateway forwards carries the request's route as
``custom_params.speculation.scope`` (per-request overrides and server-mode suffix pools alike), never a
scope a client wrote, so one route's earlier outputs never reach another route's drafts.

``dispatch`` runs for real over real ``WorkerPool`` objects and a real ``decide``; only the worker call
(``send``) is a recorder, so what is checked is the exact body a worker would receive."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from backends.sglang.errors import WorkerConnectError
from backends.worker.settings import WorkerSettings
from backends.worker.translate import speculation
from gateway.dispatch import dispatch
from gateway.errors import ApiError
from gateway.resume import resume_pools
from gateway.holds import Stopwatch
from gateway.requests import ChatRequest, parse_body
from gateway.stages import Admitted, Arrival
from policies.decide import Decision, decide
from policies.features import RequestFeatures
from policies.load import load_policy
from policies.snapshot import PoolState, Snapshot, SnapshotData
from tests.gateway.gateway_helpers import offline_backend

POLICY = """
version: 1
routes:
  - {name: ide, api_keys_env: KEYS_IDE}
  - {name: other-route}
slices: [{name: prose}]
pairs:
  ng: {target: {model: m}, draft: {kind: ngram}}
  sx: {target: {model: m}, draft: {kind: suffix}}
pools:
  plain: {proposer: none, workers: ["http://plain:1"], speculation: per_request}
  ngram: {proposer: ngram, draft_tokens: {min: 1, max: 8}, pair: ng, workers: ["http://embedded:1"],
          speculation: per_request}
  suffix: {proposer: suffix, draft_tokens: 8, pair: sx, workers: ["http://embedded:1"], speculation: per_request}
  suffix-server: {proposer: suffix, draft_tokens: 8, pair: sx, workers: ["http://suffix:1"]}
  hybrid-server: {proposer: hybrid, draft_tokens: 8, pair: sx, workers: ["http://hybrid:1"]}
  ngram-server: {proposer: ngram, draft_tokens: 4, pair: ng, workers: ["http://ngram:1"]}
rules:
  - {name: hybrid-server, when: {headers: {x-pool: hybrid-server}}, then: {pool: hybrid-server, draft_tokens: 8}}
  - {name: ngram, when: {headers: {x-pool: ngram}}, then: {pool: ngram, draft_tokens: 4}}
  - {name: suffix, when: {headers: {x-pool: suffix}}, then: {pool: suffix, draft_tokens: 8}}
  - {name: suffix-server, when: {headers: {x-pool: suffix-server}}, then: {pool: suffix-server, draft_tokens: 8}}
  - {name: ngram-server, when: {headers: {x-pool: ngram-server}}, then: {pool: ngram-server, draft_tokens: 4}}
  - {name: rest, then: bypass}
"""
# what a client might try: another route's scope (the gateway refuses it at parsing; dispatch must not
# forward it even if it got that far)
FOREIGN = {"speculation": {"scope": "other-route", "proposer": "suffix"}}


def _decision(policy, pool: str) -> Decision:
    features = RequestFeatures(route="ide", headers={"x-pool": pool})
    return decide(policy, features, Snapshot(SnapshotData(
        pools={p: PoolState(healthy=True, pair_verified=True) for p in policy.pools})))


def _dispatch(policy, decision: Decision, fail: set[str] = frozenset()) -> list[tuple[str, dict[str, Any]]]:
    """Run ``dispatch`` for a request of route ``ide``; the (worker URL, forwarded body) of every attempt.
    Workers in ``fail`` refuse the connection (the attempt is retried on the plain fallback)."""
    backend = offline_backend(policy)  # ``send`` below stands in for the workers
    state = SimpleNamespace(backend=backend,
                            settings=SimpleNamespace(max_attempts=3, abort_timeout_s=1.0),
                            spawn=lambda coro: coro.close())
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "custom_params": FOREIGN}
    admitted = Admitted(arrival=Arrival(request_id="r", endpoint="chat", t0=0.0),
                        active=SimpleNamespace(policy=policy), route="ide", body=body,
                        features=RequestFeatures(route="ide"), stream=False, include_usage=False, echo=False,
                        cost_tokens=0)
    sent: list[tuple[str, dict[str, Any]]] = []

    async def send(url: str, fwd: dict[str, Any], headers: dict[str, str] | None) -> str:
        sent.append((url, fwd))
        if url in fail:
            raise WorkerConnectError(url, "refused")
        return "ok"

    holds = SimpleNamespace(hold_worker=lambda backend, pool, url: None)
    asyncio.run(dispatch(state, admitted, decision, holds, Stopwatch(), send))
    assert body["custom_params"] is FOREIGN  # the admitted body itself is never modified
    # the served attempt's slot is held (for ``holds`` to give back); every failed one was given back
    served = sent[-1][0]
    assert backend.in_flight == 1 and [(w.url, w.in_flight) for p in backend.pools.values()
                                       for w in p.workers.values() if w.in_flight] == [(served, 1)]
    return sent


@pytest.mark.parametrize(("pool", "url", "custom_params"), [
    ("suffix", "http://embedded:1",
     {"speculation": {"proposer": "suffix", "draft_tokens": 8, "adaptive": False, "scope": "ide"}}),
    ("suffix-server", "http://suffix:1", {"speculation": {"scope": "ide"}}),
    ("hybrid-server", "http://hybrid:1", {"speculation": {"scope": "ide"}}),  # its suffix source drafts too
    ("ngram", "http://embedded:1",
     {"speculation": {"proposer": "ngram", "draft_tokens": 4, "adaptive": False, "scope": "ide"}}),
    ("rest", "http://plain:1", {"speculation": {"proposer": "none", "scope": "ide"}}),
    ("ngram-server", "http://ngram:1", None),  # an SGLang server: the gateway sends it no custom_params
])
def test_the_forwarded_scope_is_the_requests_route_never_the_clients(pool, url, custom_params):
    policy = load_policy(POLICY, "p.yaml")
    decision = _decision(policy, pool)
    assert decision.rule == pool
    [(sent_to, fwd)] = _dispatch(policy, decision)
    assert sent_to == url and fwd.get("custom_params") == custom_params
    assert fwd["rid"] == "r-1" and fwd["messages"] == [{"role": "user", "content": "hi"}]
    if custom_params is not None:  # what the embedded worker makes of it: the route's scope
        algorithm = {"suffix-server": "SUFFIX", "hybrid-server": "HYBRID"}.get(pool)
        server = WorkerSettings(speculative_algorithm=algorithm, speculative_num_draft_tokens=8)
        spec = speculation(fwd["custom_params"], server.default_speculation, "")
        assert (spec.proposer, spec.scope) == (decision.proposer, "ide")


def test_a_fallback_attempt_keeps_the_routes_scope():
    policy = load_policy(POLICY, "p.yaml")
    sent = _dispatch(policy, _decision(policy, "suffix-server"), fail={"http://suffix:1"})
    assert [(url, fwd["rid"], fwd["custom_params"]) for url, fwd in sent] == [
        ("http://suffix:1", "r-1", {"speculation": {"scope": "ide"}}),
        ("http://plain:1", "r-2", {"speculation": {"proposer": "none", "scope": "ide"}}),
    ]


def test_a_client_cannot_send_custom_params():
    raw = (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
           b'"custom_params": {"speculation": {"scope": "other-route"}}}')
    with pytest.raises(ApiError) as exc:
        parse_body(raw, ChatRequest)
    assert (exc.value.status, exc.value.param) == (400, "custom_params")
    assert exc.value.message == ("invalid field `custom_params`: Object contains unknown field `custom_params`; "
                                 "remove it")


@pytest.mark.parametrize("fallback", [True, False])
def test_a_resume_sends_what_dispatch_would_to_each_pool_in_the_routes_scope(fallback):
    """A resumed stream continues on the pool that served it with that decision's override, then (fallback
    allowed) on the plain pools with speculation off, each ``custom_params`` read by the worker as meant."""
    policy = load_policy(POLICY, "p.yaml")
    decision = _decision(policy, "ngram")
    pools = resume_pools(policy, decision, "ngram", "ide", fallback)
    assert [name for name, _ in pools] == (["ngram", "plain", "suffix"] if fallback else ["ngram"])
    launched = WorkerSettings(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8).default_speculation
    read = [speculation(custom, launched, "") for _, custom in pools]
    assert [(s.proposer, s.draft_tokens, s.scope) for s in read] == [("ngram", 4, "ide")] + (
        [("none", 8, "ide"), ("none", 8, "ide")] if fallback else [])
