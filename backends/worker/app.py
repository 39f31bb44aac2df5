"""`specgate worker`'s HTTP app: SGLang's native and OpenAI-compatible endpoints over the engine.

Handlers are thin (CONTRIBUTING.md #9): decode the body, translate it into an engine request, run it through
the bridge, shape the answer. Every refusal is a ``WorkerRequestError`` turned into the OpenAI error
shape by one exception handler; anything unexpected becomes a 500 with the same shape, never a crash.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.response import Stream

from backends.disconnect import unless_client_leaves
from backends.engine.types import GenerateRequest
from backends.sglang import wire
from backends.sglang import openai_wire
from backends.worker.errors import WorkerRequestError, error_body, from_decode_error
from backends.worker.faults import FaultRequest
from backends.worker.otel_spans import WorkerSpan, traced
from backends.worker.responses import OpenAIShaper, generate_body
from backends.worker.runtime import EngineFactory, WorkerRuntime
from backends.worker.settings import WorkerSettings
from backends.worker.translate import chat_request, completion_request, echo_text, generate_request

log = logging.getLogger("specgate.worker")
T = TypeVar("T")
_JSON = "application/json"
_DONE = b"data: [DONE]\n\n"
# Built at import: a body type msgspec cannot decode is a startup error, never a per-request 500.
_DECODERS = {kind: msgspec.json.Decoder(kind) for kind in (
    wire.GenerateReqInput, openai_wire.ChatCompletionRequest, openai_wire.CompletionRequest, wire.AbortRequest,
    FaultRequest)}


def _sse(obj: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _json(obj: msgspec.Struct, status: int = 200) -> Response:
    return Response(content=msgspec.json.encode(obj), media_type=_JSON, status_code=status)


async def _decode(request: Request, kind: type[T]) -> T:
    raw = await request.body()
    if not raw.strip():
        raise from_decode_error(msgspec.DecodeError("empty body"))
    try:
        return _DECODERS[kind].decode(raw)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from exc


def _stream(chunks: AsyncIterator[bytes]) -> Stream:
    return Stream(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}, status_code=200)


def _stream_error(out_message: str, code: int) -> bytes:
    """SGLang's mid-stream error chunk."""
    return _sse(wire.ErrorEnvelope(error=wire.ErrorDetail(
        message=out_message, type="InternalServerError" if code >= 500 else "BadRequestError", param=msgspec.UNSET,
        code=code, retryable=code >= 500)))


def create_app(settings: WorkerSettings, engine_factory: EngineFactory | None = None) -> Litestar:
    """The worker app. ``engine_factory`` builds the engine from its config (tests pass a tiny model)."""
    runtime = WorkerRuntime(settings, engine_factory)

    @post("/generate", status_code=200)
    async def generate(request: Request) -> Response | Stream:
        body = await _decode(request, wire.GenerateReqInput)
        bridge = runtime.ready_bridge()
        req = generate_request(body, bridge.engine.tokenizer, runtime.limits)
        prompt_tokens, version = len(req.input_ids), settings.weight_version
        texts = runtime.token_texts if body.return_text_in_logprobs else None
        events = _events(runtime, request, "generate", runtime.served_model_name, req)

        prompt_from = body.logprob_start_len if req.prompt_logprobs else None

        def shape(out: Any) -> wire.GenerateResponse:
            return generate_body(out, prompt_tokens, version, req.logprobs, texts, prompt_from)

        if not body.stream:
            return await _answer(request, events, shape)

        async def chunks() -> AsyncIterator[bytes]:
            async for out in events:
                if out.finished and _is_error(out):
                    yield _stream_error(out.finish_reason.message or "internal error", 500)
                    break
                yield _sse(shape(out))
            yield _DONE
        return _stream(chunks())

    async def openai(request: Request, req: GenerateRequest, body: Any, chat: bool, echo: str = ""
                     ) -> Response | Stream:
        runtime.ready_bridge()  # 503 while loading, before anything is built
        shaper = OpenAIShaper(chat=chat, rid=req.rid, model=body.model or runtime.served_model_name,
                              prompt_tokens=len(req.input_ids), weight_version=settings.weight_version,
                              spec_details=body.return_spec_tokens_details, logprobs=req.logprobs,
                              texts=runtime.token_texts, echo=echo, prompt_ids=req.input_ids,
                              input_ids=body.return_input_ids_in_sglext if chat else body.return_token_ids,
                              output_ids=body.return_output_ids_in_sglext if chat else body.return_token_ids,
                              skip_special_tokens=body.skip_special_tokens)
        events = _events(runtime, request, "chat" if chat else "completions", shaper.model, req)
        if not body.stream:
            return await _answer(request, events, shaper.response)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def chunks() -> AsyncIterator[bytes]:
            waiting = shaper.echo_waits  # the echoed prompt goes with its logprobs, after the prefill
            first = None if waiting else shaper.first_chunk()
            if first is not None:
                yield _sse(first)
            async for out in events:
                if out.finished and _is_error(out):
                    yield _stream_error(out.finish_reason.message or "internal error", 500)
                    break
                if waiting:
                    waiting = False
                    yield _sse(shaper.first_chunk(out))
                if (chunk := shaper.chunk(out)) is not None:
                    yield _sse(chunk)
                if out.finished:
                    for chunk in shaper.tail_chunks(out, include_usage):
                        yield _sse(chunk)
            yield _DONE
        return _stream(chunks())

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(request: Request) -> Response | Stream:
        body = await _decode(request, openai_wire.ChatCompletionRequest)
        req = chat_request(body, runtime.ready_bridge().engine.tokenizer, runtime.limits)
        return await openai(request, req, body, chat=True)

    @post("/v1/completions", status_code=200)
    async def completions(request: Request) -> Response | Stream:
        body = await _decode(request, openai_wire.CompletionRequest)
        tokenizer = runtime.ready_bridge().engine.tokenizer
        req = completion_request(body, tokenizer, runtime.limits)
        return await openai(request, req, body, chat=False, echo=echo_text(body, req, tokenizer))

    @post("/abort_request", status_code=200)
    async def abort_request(request: Request) -> Response:
        body = await _decode(request, wire.AbortRequest)
        bridge = runtime.ready_bridge()
        if body.abort_all:
            for rid in list(bridge.active):
                bridge.abort(rid)
            return _json(wire.AbortResponse(aborted=True))
        # SGLang answers 200 whether or not the rid is still running (it may just have finished)
        return _json(wire.AbortResponse(aborted=bridge.abort(body.rid)))

    @get(["/health", "/health_generate"])
    async def health(request: Request) -> Response:
        await runtime.health(force_generate=request.url.path == "/health_generate")
        return Response(content=b"", status_code=200)

    @get("/v1/loads")
    async def loads() -> Response:
        return _json(runtime.loads())

    @get(["/server_info", "/get_server_info"])
    async def server_info() -> Response:
        return _json(runtime.server_info())

    @get(["/model_info", "/get_model_info"])
    async def model_info() -> Response:
        return _json(runtime.model_info())

    @get("/v1/models")
    async def models() -> Response:
        return _json(runtime.models())

    @get("/specgate/fault")
    async def fault() -> Response:
        return _json(runtime.faults.state())

    @post("/specgate/fault", status_code=200)
    async def set_fault(request: Request) -> Response:
        runtime.faults.require()  # 404 without --fault-injection, whatever the body
        body = await _decode(request, FaultRequest)
        return _json(runtime.faults.set(body.mode))

    @get("/metrics")
    async def metrics() -> Response:
        if runtime.bridge is not None:
            runtime.metrics.refresh(runtime.bridge.engine.load())
        return Response(content=runtime.metrics.render(), media_type="text/plain; version=0.0.4")

    def on_refusal(_: Request, exc: WorkerRequestError) -> Response:
        return _json(exc.body(), exc.status)

    def on_crash(_: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        if status >= 500:
            log.exception("unhandled error", exc_info=exc)
        message = getattr(exc, "detail", None) or str(exc) or type(exc).__name__
        return _json(error_body(message, "InternalServerError" if status >= 500 else "BadRequestError",
                                status), status)

    return Litestar(
        route_handlers=[generate, chat_completions, completions, abort_request, health, loads,
                        server_info, model_info, models, metrics, fault, set_fault],
        on_startup=[runtime.start], on_shutdown=[runtime.stop],
        exception_handlers={WorkerRequestError: on_refusal, Exception: on_crash},
        state={"runtime": runtime}, debug=False,
        logging_config=None,  # structlog logs; Litestar's default config starts a queue thread per app, never stopped
    )


def _events(runtime: WorkerRuntime, request: Request, endpoint: str, model: str, req: GenerateRequest
            ) -> AsyncIterator[Any]:
    """Submit ``req`` (refusals raise here) and iterate its engine events; with trace export on
    (``runtime.otel``), inside the request's span (``backends/worker/otel_spans.py``)."""
    if runtime.otel is None:
        return runtime.ready_bridge().events(req)
    span = WorkerSpan(runtime.otel, request.headers, endpoint, model, req)
    try:
        events = runtime.ready_bridge().events(req)
    except Exception as exc:
        span.refused(exc)
        raise
    return traced(events, span)


async def _answer(request: Request, events: AsyncIterator[Any], shape: Callable[[Any], msgspec.Struct]
                  ) -> Response:
    """A non-streamed answer. A client that disconnects first cancels the wait, which aborts the
    engine request (``EngineBridge._drain``) so its running slot and KV blocks are freed at once."""
    async def finished() -> Any:
        async for out in events:
            if out.finished:
                return out
        raise RuntimeError("engine stream ended without a finished event")  # pragma: no cover

    answered, out = await unless_client_leaves(request.receive, finished())
    if not answered:
        return Response(content=b"", status_code=499)  # nobody reads it
    return _finished_json(out, shape(out))


def _is_error(out: Any) -> bool:
    return out.finish_reason is not None and out.finish_reason.type == "abort" and \
        (out.finish_reason.status_code or 0) >= 500


def _finished_json(out: Any, body: msgspec.Struct) -> Response:
    """A non-streamed answer: 500 in the error shape when the engine failed the request."""
    if _is_error(out):
        return _json(error_body(out.finish_reason.message or "internal error", "InternalServerError", 500), 500)
    return _json(body)
