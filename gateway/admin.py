"""Admin API (``/admin/*``), guarded by its own bearer token (``--admin-token-env``, default
``SPECGATE_ADMIN_TOKEN``); with no token set the admin API is closed (403). Read-only:

- ``GET /admin/policy``: the policy in force (version, path), the last reload attempt with its errors.
- ``POST /admin/explain``: an OpenAI chat/completions body -> slice, every rule tried, auto candidates
  and the decision, against the live snapshot (``?route=NAME`` to explain as that route).
- ``GET /admin/pools``: per pool its live snapshot, declared pair and each worker's health, load,
  KV usage, reported identity, pair mismatches and in-flight count.
- ``GET /admin/stats``: the learned acceptance and cost statistics (the decision snapshot).
- ``GET /admin/requests``: what the requests in flight hold now: the in-flight count the policy sees,
  explorations in flight per ``slice|pool``, each route's admission state and each worker's slots
  (all zero and empty when the gateway is idle).
- ``GET /admin/tracing``: trace recording (``gateway/tracing.py``): on or off, the configuration in force,
  the current file's header (model, revision, tokenizer), its size and the files kept, and how many
  finished requests were recorded or not, and why (never a record's content).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Request, Response, Router, get, post

from gateway.auth import admin_allowed
from gateway.errors import ApiError
from gateway.requests import ChatRequest, CompletionRequest, parse_body
from policies.decide import explain
from policies.features import features_from_openai

if TYPE_CHECKING:
    from gateway.state import GatewayState

_JSON = "application/json"


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
        route = request.query_params.get("route") or active.policy.default_route or "default"
        features = features_from_openai(body, route=route, headers=dict(request.headers),
                                        wanted_headers=set(active.wanted_headers))
        return _json(explain(active.policy, features, state.snapshot()))

    @get("/pools", summary="Pools and workers: health, load, KV usage, pair identity")
    async def pools(request: Request[Any, Any, Any]) -> Response[bytes]:
        if (refused := guard(request)) is not None:
            return refused
        now = time.monotonic()
        return _json({name: {"snapshot": pool.snapshot(now), "expected_pair": pool.expected,
                             "workers": [_worker_view(w, now) for w in pool.workers.values()]}
                      for name, pool in state.backend.pools.items()})

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

    return Router(path="/admin", route_handlers=[policy, explain_request, pools, stats, requests, tracing])
