"""``create_app(settings) -> Litestar``: the gateway's one app factory (CONTRIBUTING.md #9).

Controllers are thin: the OpenAI endpoints hand the request to its one owner (``lifecycle.serve``) and
return the answer it gives. Worker clients, the pool monitor and the policy watcher open and close in the
lifespan; an invalid policy file fails ``create_app``, never a request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import structlog
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import ASGIApp, Receive, Scope, Send

from gateway.admin import admin_router
from gateway.errors import ApiError
from gateway.lifecycle import JSON, body_too_large, serve
from gateway.outcomes import outcomes_handler
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from telemetry.dashboard import router as dashboard_router

log = structlog.get_logger("specgate.gateway")


def error_response(exc: ApiError, headers: dict[str, str] | None = None) -> Response[bytes]:
    return Response(exc.body(), status_code=exc.status, media_type=JSON,
                    headers={**(headers or {}), **exc.headers()})


class WholeAnswer:
    """A whole JSON answer as a bare ASGI app: two ``send`` calls with the headers encoded once. Litestar's
    ``Response`` would build a header container and an ``ASGIResponse`` per answer: without them the gateway
    spends 0.87x the CPU per request at c32 (bench.gateway_compare, docs/runs/2026-12-06-gateway-cpu). This path
    has no cookies or background tasks to carry."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.body = status, body
        self.headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        *((name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


class RawRequest:
    """What ``lifecycle.serve`` reads of a request (``headers``, ``body()``, ``receive``) straight from the
    ASGI scope, for the OpenAI endpoints' fast path (:class:`GatewayApp`). Header names arrive lower-cased
    (ASGI); of a repeated header the first counts, as with Litestar's ``Headers.get``."""

    __slots__ = ("headers", "limit", "receive")

    def __init__(self, scope: Scope, receive: Receive, limit: int) -> None:
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        self.headers, self.receive, self.limit = headers, receive, limit

    async def body(self) -> bytes:
        chunks, size = [], 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ApiError(499, "the client disconnected while sending the request body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                raise body_too_large(self.limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _openai(state: GatewayState, request: Any, endpoint: str) -> ASGIApp:
    """Hand the request to its owner (``lifecycle.serve``) and shape what comes back."""
    life = serve(state, endpoint, request)
    try:
        head = await anext(life)
    except BaseException:
        state.spawn(life.aclose())
        raise
    assert not isinstance(head, bytes)
    if head.body is None:
        return ASGIStreamingResponse(iterator=life, media_type="text/event-stream", headers=head.headers)
    if head.status != 200:  # refused or failed: nothing to wait for, the request ends here
        await life.aclose()
        return WholeAnswer(head.status, head.headers, head.body)
    # recorded on the next loop turn, after the body is handed to the server: the client does not wait
    # for metrics and logs, and the record happens even if the client is gone by then
    asyncio.get_running_loop().call_soon(_end_now, life)
    return WholeAnswer(head.status, head.headers, head.body)


def _end_now(life: AsyncGenerator[Any, None]) -> None:
    """End a request whose whole answer was handed over, as a plain callback, with no task or background
    step per request on the hot path: ``serve`` is suspended after its last item, returns when resumed, and
    its ``finally`` never awaits, so one step of ``asend()`` runs it to the end (no ``GeneratorExit`` thrown
    through it, which ``aclose()`` would cost)."""
    step = life.asend(None)
    try:
        step.send(None)
    except StopAsyncIteration:
        return
    except StopIteration:  # it yielded again: left to the event loop's async-generator finaliser
        pass
    else:
        step.close()
    log.error("gateway_internal_error", cause="lifecycle.serve awaited while closing a whole answer")


def _http_exception(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    """Litestar's own refusals (404 path, 405, 413 while streaming the body) in OpenAI's shape."""
    code = "body_too_large" if exc.status_code == 413 else None
    return error_response(ApiError(exc.status_code, str(exc.detail), code=code), dict(exc.headers or {}))


def _internal_error() -> ApiError:
    return ApiError(500, "internal gateway error; see the gateway log", error_type="internal_error")


def _internal(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    log.exception("gateway_internal_error", path=request.url.path)
    return error_response(_internal_error())


class GatewayApp(Litestar):
    """The gateway's Litestar app, with a fast path: a POST to exactly ``/v1/chat/completions`` or
    ``/v1/completions`` goes to ``lifecycle.serve`` before Litestar's router, middleware and handler layers,
    which cost a fifth of the gateway's CPU per request (0.81x CPU, 1.24x req/s at c32 without them, 10 rounds of
    bench.gateway_compare: docs/runs/2026-12-06-gateway-fastpath). Everything else, and any other spelling of
    those paths (a trailing slash), is Litestar's, whose handlers for the two endpoints serve the same way
    (and document them in the OpenAPI schema)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = FAST_PATHS.get(scope["path"])
            if endpoint is not None:
                state: GatewayState = self.state.gateway
                try:
                    answer = await _openai(state, RawRequest(scope, receive, state.settings.max_body_bytes), endpoint)
                except Exception:  # what Litestar's `_internal` handler does for its routes
                    log.exception("gateway_internal_error", path=scope["path"])
                    answer = WholeAnswer(500, {}, _internal_error().body())
                await answer(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


FAST_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


def create_app(settings: GatewaySettings) -> Litestar:
    state = GatewayState(settings)

    @post("/v1/chat/completions", status_code=200, summary="OpenAI chat completions (streaming and not)")
    async def chat_completions(request: Request[Any, Any, Any]) -> ASGIApp:
        return await _openai(state, request, "chat")

    @post("/v1/completions", status_code=200, summary="OpenAI text completions (streaming and not)")
    async def completions(request: Request[Any, Any, Any]) -> ASGIApp:
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

    handlers: list[Any] = [chat_completions, completions, models, health, ready, metrics, outcomes_handler(state),
                           admin_router(state), dashboard_router(state.telemetry)]
    app = GatewayApp(
        route_handlers=handlers, on_startup=[state.start], on_shutdown=[state.stop],
        request_max_body_size=settings.max_body_bytes,
        exception_handlers={HTTPException: _http_exception, Exception: _internal},
        openapi_config=OpenAPIConfig(title="specgate gateway", version="0.1.0"),
        logging_config=None,  # structlog logs; Litestar's default config starts a queue thread per app, never stopped
        debug=False)
    app.state.gateway = state
    return app
