"""Admin API (``/admin/*``), guarded by its own bearer token (``--admin-token-env``, default
``SPECGATE_ADMIN_TOKEN``); with no token set the admin API is closed (403). Read-only but for the gate
re-check:

- ``GET /admin/policy``: the policy in force (version, path), the last reload attempt with its errors.
- ``POST /admin/explain``: an OpenAI chat/completions body -> slice, every rule tried, auto candidates
  and the decision, against the live snapshot (``?route=NAME`` to explain as that route).
- ``GET /admin/pools``: per pool its live snapshot, declared pair, pair gate (state, reason, last verdict,
  ramp regions, accept-length windows, outcomes, history; ``gateway/gates/book.py``) and each worker's
  health, load, KV usage, reported identity, pair mismatches and in-flight count.
- ``POST /admin/pools/NAME/check``: run NAME's equivalence gate again (202; it goes back to pending and
  serves no user request until the new verdict; 409 while a run is in progress).
- ``GET /admin/stats``: the learned acceptance and cost statistics (the decision snapshot).
- ``GET /admin/requests``: what the requests in flight hold now: the in-flight count the policy sees,
  explorations in flight per ``slice|pool``, each route's admission state and each worker's slots
  (all zero and empty when the gateway is idle).
- ``GET /admin/fleet``: fleet state (``gateway/fleet.py``): the store (scheme and host only), whether it
  answers, the last sync and its duration, the replicas with a live heartbeat (policy digest, pid, in flight).
- ``GET /admin/tracing``: trace recording (``gateway/tracing.py``): on or off, the configuration in force,
  the current file's header (model, revision, tokenizer), its size and the files kept, and how many
  finished requests were recorded or not, and why (never a record's content).
- ``POST /admin/replay``: ``{"policy": "<candidate policy YAML>", "last": 500, "loads": ["trace"], "seeds": 3}``
  -> the candidate and the policy in force replayed on the newest recorded requests (replay/
  candidate.py): markdown and figures, and ``costs``, what priced them: ``tracing.costs``' file, else the live
  step costs of the first healthy worker reporting them (one of the trace's revision when there is one;
  ``policies.live_costs.from_server_info``). Refused (409) when tracing is off or there is neither; one at a
  time (429); bounded by ``REPLAY_DEADLINE_S``. It runs on a thread of this process, so it
  shares the gateway's CPU while it runs: prefer ``specgate policy explain --replay`` on another machine
  for large replays.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta
from litestar import Request, Response, Router, get, post

from gateway.auth import admin_allowed
from gateway.errors import ApiError
from gateway.requests import ChatRequest, CompletionRequest, parse_body
from gateway.slo_headers import slo_in_force
from policies.costmodel import CostModelError, load_cost_model
from policies.decide import explain
from policies.errors import PolicyError
from policies.features import features_from_openai
from policies.live_costs import from_server_info
from policies.load import load_policy
from policies.trace import TraceError
from replay.candidate import ReplayTimeout, recorded, replay_candidate
from replay.sim import Load

if TYPE_CHECKING:
    from pathlib import Path

    from backends.sglang.wire import ServerInfo
    from gateway.state import GatewayState
    from policies.costmodel import CostModel

    Reports = list[tuple[str, ServerInfo]]  # (url, last /server_info) of workers reporting step costs

_JSON = "application/json"


REPLAY_DEADLINE_S = 60.0


class ReplayBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    policy: str  # the candidate policy file's text
    last: Annotated[int, Meta(ge=1, le=5000)] = 500
    loads: Annotated[list[str], Meta(min_length=1, max_length=4)] = msgspec.field(default_factory=lambda: ["trace"])
    seeds: Annotated[int, Meta(ge=1, le=10)] = 3


def _problem(status: int, message: str, code: str, errors: list[str] | None = None) -> Response[bytes]:
    """An OpenAI-shaped error (as every API error), with the policy check's ``errors`` beside it."""
    body = ApiError(status, message, code=code).body()
    if errors is not None:
        body = body[:-1] + b',"errors":' + msgspec.json.encode(errors) + b"}"
    return Response(body, status_code=status, media_type=_JSON)


def _json(value: Any, status: int = 200) -> Response[bytes]:
    return Response(msgspec.json.encode(value), status_code=status, media_type=_JSON)


def _worker_view(worker: Any, now: float) -> dict[str, Any]:
    load = worker.load
    return {
        "url": worker.url, "healthy": worker.healthy, "ejected": worker.ejected(now),
        "ejected_for_s": round(worker.ejected_until - now, 3) if worker.ejected(now) else None,
        "consecutive_failures": worker.consecutive_failures, "last_error": worker.last_error,
        "in_flight": worker.in_flight,
        "load": None if load is None else {
            "running": load.running, "waiting": load.waiting, "kv_usage": load.token_usage,
            "max_running_requests": load.max_running_requests, "accept_length": load.accept_length,
            "age_s": round(now - load.at, 3)},
        "identity": worker.identity, "pair_mismatches": worker.mismatches,
    }


def admin_router(state: GatewayState) -> Router:
    token = os.environ.get(state.settings.admin_token_env) or None

    def guard(request: Request[Any, Any, Any]) -> Response[bytes] | None:
        if token is None:
            return Response(ApiError(403, f"admin API disabled: set {state.settings.admin_token_env} "
                                     "to enable it", code="admin_disabled").body(),
                            status_code=403, media_type=_JSON)
        if not admin_allowed(token, request.headers.get("authorization")):
            return Response(ApiError(401, "missing or invalid admin token; send `Authorization: "
                                     "Bearer <admin token>`", code="invalid_admin_token").body(),
                            status_code=401, media_type=_JSON)
        return None

    @get("/policy", summary="Policy in force and the last reload result")
    async def policy(request: Request[Any, Any, Any]) -> Response[bytes]:
        if (refused := guard(request)) is not None:
            return refused
        active = state.active
        return _json({
            "path": str(state.path), "version": active.version,
            "auth_enabled": active.keys.enabled, "api_keys": active.keys.key_count,
            "key_problems": active.keys.problems,
            "routes": active.policy.route_names(), "pools": sorted(active.policy.pools),
            "pair_versions": active.pair_versions,
            "last_reload": state.last_reload,
        })

    @post("/explain", status_code=200, summary="Explain the decision for an OpenAI request body")
    async def explain_request(request: Request[Any, Any, Any]) -> Response[bytes]:
        if (refused := guard(request)) is not None:
            return refused
        raw = await request.body()
        kind = CompletionRequest if b'"prompt"' in raw and b'"messages"' not in raw else ChatRequest
        try:
            body, _ = parse_body(raw, kind)
        except ApiError as exc:
            return Response(exc.body(), status_code=exc.status, media_type=_JSON)
        active = state.active
        policy = active.policy
        route = request.query_params.get("route") or policy.default_route or "default"
        try:  # the request's SLO as admission takes it: its x-slo-* headers over the route's
            _, slo_fields = slo_in_force(request.headers, route, policy)
        except ApiError as exc:
            return Response(exc.body(), status_code=exc.status, media_type=_JSON)
        features = features_from_openai(body, route=route, headers=dict(request.headers),
                                        wanted_headers=set(active.wanted_headers), **slo_fields)
        return _json(explain(policy, features, state.snapshot()))

    @get("/pools", summary="Pools and workers: health, load, KV usage, pair identity")
    async def pools(request: Request[Any, Any, Any]) -> Response[bytes]:
        if (refused := guard(request)) is not None:
            return refused
        now = time.monotonic()
        return _json({name: {"snapshot": pool.snapshot(now), "expected_pair": pool.expected,
                             "gate": state.gates.view(name, now),
                             "workers": [_worker_view(w, now) for w in pool.workers.values()]}
                      for name, pool in state.backend.pools.items()})

    @post("/pools/{name:str}/check", status_code=202, summary="Run a pool's equivalence gate again")
    async def check(request: Request[Any, Any, Any], name: str) -> Response[bytes]:
        if (refused := guard(request)) is not None:
            return refused
        if name not in state.gates.pools:
            return _problem(404, f"pool '{name}' has no pair gate (unknown pool, no pair, or no gates: section "
                            f"in the policy); gated pools: {', '.join(sorted(state.gates.pools)) or 'none'}",
                            "no_such_gate")
        if not state.gate_runs.recheck(name, time.monotonic(), time.time()):
            return _problem(409, f"pool '{name}''s equivalence gate is running; wait for its verdict "
                            "(GET /admin/pools)", "gate_running")
        return _json({"pool": name, "gate": state.gates.view(name, time.monotonic())}, status=202)

    @get("/stats", summary="Learned acceptance and cost statistics")
    async def stats(request: Request[Any, Any, Any]) -> Response[bytes]:
        if (refused := guard(request)) is not None:
            return refused
        return Response(state.snapshot().to_json(), media_type=_JSON)

    @get("/requests", summary="What the requests in flight hold: counts, exploration slots, route limits")
    async def requests(request: Request[Any, Any, Any]) -> Response[bytes]:
        if (refused := guard(request)) is not None:
            return refused
        backend = state.backend
        return _json({
            "in_flight": state.in_flight, "exploring": state.exploring,
            "routes": {name: limiter.view() for name, limiter in state.active.limiters.items()},
            "workers_in_flight": backend.in_flight,
            "pools": {name: {w.url: w.in_flight for w in pool.workers.values()}
                      for name, pool in backend.pools.items()}})

    @get("/tracing", summary="Trace recording: configuration, files and counts")
    async def tracing(request: Request[Any, Any, Any]) -> Response[bytes]:
        if (refused := guard(request)) is not None:
            return refused
        return _json(state.recorder.status())

    running = asyncio.Lock()

    @post("/replay", status_code=200, summary="Replay a candidate policy on the newest recorded requests")
    async def replay(request: Request[Any, Any, Any]) -> Response[bytes]:
        if (refused := guard(request)) is not None:
            return refused
        config = state.recorder.config
        if config is None:
            return _problem(409, "tracing is off: turn it on (tracing: in the policy, or specgate serve --trace) "
                            "and let it record", "tracing_off")
        live = state.backend.step_cost_reports(time.monotonic()) if config.costs is None else []
        if config.costs is None and not live:
            return _problem(409, "no cost model: set tracing.costs to a file from specgate trace calibrate, or "
                            "serve with a specgate worker that calibrates at start-up (no healthy worker reports "
                            "step costs in /server_info)", "no_cost_model")
        try:
            body = msgspec.json.decode(await request.body(), type=ReplayBody)
        except msgspec.ValidationError as exc:
            return _problem(400, f"invalid body: {exc}", "invalid_body")
        except msgspec.DecodeError as exc:
            return _problem(400, f"invalid JSON: {exc}", "invalid_json")
        if running.locked():
            return _problem(429, "a replay is already running; retry when it ends", "replay_running")
        async with running:
            return await asyncio.to_thread(_replay_now, state, config, body, live)

    @get("/fleet", summary="Fleet state: the store's health, last sync, the replicas seen")
    async def fleet(request: Request[Any, Any, Any]) -> Response[bytes]:
        if (refused := guard(request)) is not None:
            return refused
        if state.fleet is None:
            return _json({"enabled": False, "replicas": {}})
        own = state.learning.tables()
        return _json({"enabled": True, **state.fleet.view(), "exploring": state.exploring,
                      # this replica's own evidence (what it publishes): requests ever learned per table
                      "own_evidence": {"arms": sum(s.ever for s in own["arms"].values()),
                                       "acceptance": sum(s.ever_requests for s in own["acceptance"].values())}})

    return Router(path="/admin", route_handlers=[policy, explain_request, pools, check, stats, requests, tracing,
                                                    replay, fleet])


def _replay_now(state: GatewayState, config: Any, body: ReplayBody, live: Reports) -> Response[bytes]:
    """The candidate and the policy in force on the newest ``body.last`` recorded requests (a thread);
    ``live``: the workers' step-cost reports, used when ``config.costs`` names no file."""
    try:
        candidate = load_policy(body.policy, "candidate.yaml")
    except PolicyError as exc:
        return _problem(422, "the candidate policy is invalid", "invalid_policy", exc.errors)
    try:
        for label in body.loads:
            Load.parse(label)
        trace = recorded(config.path, config.keep, body.last)
        costs, priced = _costs(config.costs, live, trace.header.revision)
        result = replay_candidate(trace, {"in force": state.active.policy, "candidate": candidate}, costs,
                                  loads=tuple(body.loads), seeds=body.seeds, deadline_s=REPLAY_DEADLINE_S,
                                  source=str(config.path))
    except ReplayTimeout as exc:
        return _problem(504, str(exc), "replay_timeout")
    except (TraceError, CostModelError, ValueError, OSError) as exc:
        return _problem(422, str(exc), "cannot_replay")
    return _json({"requests": result.requests, "excluded_pools": result.excluded, "costs": priced,
                  "markdown": result.markdown, "summary": result.summary})


def _costs(path: Path | None, live: Reports, revision: str) -> tuple[CostModel, str]:
    """The cost model that prices a replay of a trace of ``revision``, and its source: the file at ``path``,
    else the live step costs of the first worker in ``live`` serving that revision (the first of all when none
    does, which the revision check then refuses, naming both revisions)."""
    if path is not None:
        return load_cost_model(path, revision=revision), f"file {path}"
    url, info = next(((url, info) for url, info in live if info.revision == revision), live[0])
    costs = from_server_info(info, url, revision=revision)
    return costs, f"worker {url} live step costs (one context: {costs.forward[0].context[0]} tokens)"
