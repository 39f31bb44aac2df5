"""``create_app(settings) -> Litestar``: the gateway's one app factory (STYLE.md #9).

Controllers are thin: read the body (refusing one over ``max_body_bytes`` before parsing), call the
lifecycle, return. Worker clients, the pool monitor and the policy watcher open and close in the
lifespan; an invalid policy file fails ``create_app``, never a request.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig
from litestar.response import Stream

from backends.disconnect import unless_client_leaves
from gateway.admin import admin_router
from gateway.call import Call
from gateway.errors import ApiError
from gateway.lifecycle import admit
from gateway.relay import JSON, answer_json, answer_stream
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from gateway.telemetry_port import dashboard_router

log = structlog.get_logger("specgate.gateway")


def error_response(exc: ApiError, headers: dict[str, str] | None = None) -> Response[bytes]:
    return Response(exc.body(), status_code=exc.status, media_type=JSON,
                    headers={**(headers or {}), **exc.headers()})


async def _read_body(request: Request[Any, Any, Any], limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes, over this gateway's limit of {limit} "
                       "bytes (--max-body-bytes); send a shorter prompt", code="body_too_large")
    return await request.body()


async def _openai(state: GatewayState, request: Request[Any, Any, Any], endpoint: str
                  ) -> Response[bytes] | Stream:
    try:
        raw = await _read_body(request, state.settings.max_body_bytes)
        call, body = admit(state, endpoint, raw, request.headers)
    except ApiError as exc:
        call = getattr(exc, "call", None) or Call(state=state, active=state.active, endpoint=endpoint)
        call.finish(exc.status, exc.status_class, error_type=exc.error_type, error_message=exc.message)
        return error_response(exc, call.headers())
    try:
        if call.stream:
            return await answer_stream(call, body)
        answered, response = await unless_client_leaves(request.receive, answer_json(call, body))
        if answered:
            assert response is not None
            return response
        # dispatch already freed the worker slot and sent /abort_request; nobody reads this answer
        call.finish(499, "aborted", error_type="ClientDisconnected",
                    error_message="client closed the connection before the answer")
        return Response(b"", status_code=499)
    except ApiError as exc:
        call.finish(exc.status, exc.status_class, error_type=exc.error_type, error_message=exc.message)
        return error_response(exc, call.headers())
    except BaseException:
        call.finish(500, "upstream_error", error_type="InternalError", error_message="gateway error")
        raise


def _http_exception(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    """Litestar's own refusals (404 path, 405, 413 while streaming the body) in OpenAI's shape."""
    code = "body_too_large" if exc.status_code == 413 else None
    return error_response(ApiError(exc.status_code, str(exc.detail), code=code), dict(exc.headers or {}))


def _internal(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    log.exception("gateway_internal_error", path=request.url.path)
    return error_response(ApiError(500, "internal gateway error; see the gateway log",
                                   error_type="internal_error"))


def create_app(settings: GatewaySettings) -> Litestar:
    state = GatewayState(settings)

    @post("/v1/chat/completions", status_code=200, summary="OpenAI chat completions (streaming and not)")
    async def chat_completions(request: Request[Any, Any, Any]) -> Response[bytes] | Stream:
        return await _openai(state, request, "chat")

    @post("/v1/completions", status_code=200, summary="OpenAI text completions (streaming and not)")
    async def completions(request: Request[Any, Any, Any]) -> Response[bytes] | Stream:
        return await _openai(state, request, "completions")

    @get("/v1/models", summary="Models served by the workers")
    async def models() -> dict[str, Any]:
        now = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now, "owned_by": "specgate"}
            for name in state.backend.model_names()]}

    @get("/health", summary="The gateway process is up")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @get("/ready", summary="Some pool has a healthy worker (503 otherwise)")
    async def ready() -> Response[dict[str, Any]]:
        now = time.monotonic()
        healthy = {name: len(pool.selectable(now)) for name, pool in state.backend.pools.items()}
        ok = any(healthy.values())
        return Response({"ready": ok, "healthy_workers": healthy}, status_code=200 if ok else 503)

    @get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response[bytes]:
        content, content_type = state.telemetry.metrics_response()
        return Response(content, media_type=content_type)

    handlers: list[Any] = [chat_completions, completions, models, health, ready, metrics,
                           admin_router(state)]
    dashboard = dashboard_router(state.telemetry)
    if dashboard is not None:
        handlers.append(dashboard)
    app = Litestar(
        route_handlers=handlers, on_startup=[state.start], on_shutdown=[state.stop],
        request_max_body_size=settings.max_body_bytes,
        exception_handlers={HTTPException: _http_exception, Exception: _internal},
        openapi_config=OpenAPIConfig(title="specgate gateway", version="0.1.0"),
        debug=False)
    app.state.gateway = state
    return app
