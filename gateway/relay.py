"""Answering: the JSON body, or the worker's stream relayed chunk by chunk as it arrives.

Chunks are forwarded as the exact bytes the worker sent (no re-serialisation). Three are handled:
the ``sglext`` chunk (speculation stats, consumed), the usage chunk (forwarded only when the client
asked for ``stream_options.include_usage``; the gateway always asks the worker for it) and the
finishing chunk, held until the stats arrive so the LAST chunk before ``[DONE]`` can carry the
``specgate`` object, spliced into its JSON text. After the first byte a worker failure ends the
stream with an OpenAI-style error event and ``[DONE]``; a client that goes away gets its worker
request aborted (``/abort_request`` with the rid the gateway assigned) within ``abort_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Response
from litestar.response import Stream

from backends.sglang.client import OpenAIResult, SGLangClient
from backends.sglang.errors import WorkerError, WorkerStreamError
from backends.sglang.spec_stats import spec_stats_from_sglext
from gateway.call import Call
from gateway.errors import ApiError
from gateway.lifecycle import _worker_fault, abort_upstream, dispatch, release

DONE = b"data: [DONE]\n\n"
JSON = "application/json"


def inject(raw: bytes, info: bytes) -> bytes:
    """Add ``"specgate": info`` to the JSON object text ``raw`` without re-encoding it."""
    body = raw.rstrip()
    return body[:-1] + b',"specgate":' + info + b"}"


def _take_usage(call: Call, parsed: Any) -> None:
    if parsed.usage is not None:
        call.prompt_tokens = parsed.usage.prompt_tokens
        call.completion_tokens = parsed.usage.completion_tokens
    if parsed.sglext is not None:
        call.stats = spec_stats_from_sglext(parsed.sglext) or call.stats


async def answer_json(call: Call, body: dict[str, Any]) -> Response[bytes]:
    chat = call.endpoint == "chat"

    async def send(client: SGLangClient, fwd: dict[str, Any]) -> OpenAIResult[Any]:
        return await (client.chat_completions(fwd) if chat else client.completions(fwd))

    result = await dispatch(call, body, send)
    release(call, ok=True)
    _take_usage(call, result.parsed)
    content = inject(result.raw, call.info_json())
    headers = call.headers()
    call.overhead_final = call.overhead_s()
    # recorded on the next loop turn, after the body is handed to the server: the client does not
    # wait for metrics and logs, and the record happens even if the client is gone by then
    asyncio.get_running_loop().call_soon(call.finish, 200)
    return Response(content, media_type=JSON, headers=headers)


async def answer_stream(call: Call, body: dict[str, Any]) -> Stream:
    chat = call.endpoint == "chat"
    body = {**body, "stream_options": {"include_usage": True}}

    async def send(client: SGLangClient, fwd: dict[str, Any]) -> tuple[Any, OpenAIResult[Any]]:
        stream = (client.chat_completions_stream(fwd) if chat else client.completions_stream(fwd))
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            raise WorkerStreamError(client.base_url, "stream ended before any chunk",
                                    bytes_received=False) from None
        except BaseException:
            await stream.aclose()
            raise
        return stream, first

    upstream, first = await dispatch(call, body, send)
    client = call.backend.client(call.worker)
    return Stream(_relay(call, client, upstream, first), media_type="text/event-stream",
                  headers={**call.headers(), "cache-control": "no-cache", "x-accel-buffering": "no"})


def _has_content(parsed: Any, chat: bool) -> bool:
    for choice in parsed.choices:
        if chat:
            if choice.delta.content or choice.delta.tool_calls:
                return True
        elif choice.text:
            return True
    return False


async def _relay(call: Call, client: SGLangClient, upstream: AsyncIterator[OpenAIResult[Any]],
                 first: OpenAIResult[Any]) -> AsyncIterator[bytes]:
    chat = call.endpoint == "chat"
    held_finish: bytes | None = None
    usage_raw: bytes | None = None
    echo_pending = call.echo
    completed = False
    try:
        item: OpenAIResult[Any] | None = first
        while item is not None:
            parsed = item.parsed
            special = parsed.sglext is not None or (parsed.usage is not None and not parsed.choices)
            _take_usage(call, parsed)
            if special:
                if parsed.usage is not None:
                    usage_raw = item.raw
            elif any(c.finish_reason for c in parsed.choices):
                held_finish = item.raw
                if call.ttft_s is None:
                    call.ttft_s = time.perf_counter() - call.t0
            else:
                if call.ttft_s is None and _has_content(parsed, chat):
                    if echo_pending:  # the echoed prompt, sent before any token is generated
                        echo_pending = False
                    else:
                        call.ttft_s = time.perf_counter() - call.t0
                yield b"data: " + item.raw + b"\n\n"
            started = time.perf_counter()
            try:
                item = await upstream.__anext__()
            except StopAsyncIteration:
                item = None
            finally:
                call.upstream_s += time.perf_counter() - started
        info = call.info_json()
        if held_finish is not None and usage_raw is not None and call.include_usage:
            yield b"data: " + held_finish + b"\n\n"
            yield b"data: " + inject(usage_raw, info) + b"\n\n"
        elif held_finish is not None:
            yield b"data: " + inject(held_finish, info) + b"\n\n"
        elif usage_raw is not None and call.include_usage:
            yield b"data: " + inject(usage_raw, info) + b"\n\n"
        yield DONE
        completed = True
        release(call, ok=True)
        call.finish(200)
    except WorkerError as exc:
        if _worker_fault(exc) and call.backend is not None:
            call.backend.pools[call.pool].report_failure(call.worker, time.monotonic(), str(exc))
        release(call, ok=False)
        error = ApiError(502, f"the worker failed mid-stream: {exc.message}", code="upstream_error")
        call.finish(502, "upstream_error", error_type="WorkerError", error_message=error.message)
        yield error.stream_chunk()
        yield DONE
        completed = True
    finally:
        if not completed:  # the client went away (cancellation or close at a yield)
            state = call.state
            state.spawn(_close(upstream))
            state.spawn(abort_upstream(client, call.rid, state.settings.abort_timeout_s))
            release(call, ok=True)
            call.finish(499, "aborted", error_type="ClientDisconnected",
                        error_message="client closed the connection mid-stream")


async def _close(upstream: AsyncIterator[Any]) -> None:
    with contextlib.suppress(Exception):
        await upstream.aclose()  # type: ignore[attr-defined]
