"""The async client against a real HTTP server replaying recorded SGLang bodies (no mocks)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from backends.sglang.client import ClientTimeouts, SGLangClient
from backends.sglang.errors import (
    WorkerConnectError,
    WorkerHTTPError,
    WorkerStreamError,
    WorkerTimeout,
)
from backends.sglang.spec_stats import spec_stats_from, spec_stats_from_sglext
from backends.sglang.wire import GenerateRequest, SamplingParams
from tests.backends.replay_server import Reply, ReplayServer, fixture_bytes

REQ = GenerateRequest(text="The capital of France is", rid="rid-1",
                      sampling_params=SamplingParams(max_new_tokens=12, temperature=0.0))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def _with(routes, body, **client_kw):
    async with ReplayServer(routes) as server:
        async with SGLangClient(server.url, **client_kw) as client:
            return await body(client), server


def test_generate_non_stream_and_request_body():
    async def body(c):
        return await c.generate(REQ)
    resp, server = run(_with({("POST", "/generate"): Reply.fixture("generate.json")}, body))
    assert resp.meta_info.completion_tokens == 12
    assert spec_stats_from(resp.meta_info).verify_ct == 5
    assert server.received[0].body == {
        "text": "The capital of France is", "rid": "rid-1",
        "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}


async def _collect(stream):
    return [event async for event in stream]


def test_generate_stream_cumulative_becomes_deltas():
    async def body(c):
        return await _collect(c.generate_stream(REQ))
    events, server = run(_with({("POST", "/generate"): Reply.fixture("generate_stream.sse")}, body))
    assert [e.text for e in events] == [" Paris", ".", " It is", " known"]
    assert [e.output_ids for e in events] == [[7042], [30], [657, 314], [2428, 2]]
    assert [e.finished for e in events] == [False, False, False, True]
    assert events[-1].meta_info.e2e_latency == 0.21
    assert spec_stats_from(events[-1].meta_info).accept_length == 2.0
    assert server.received[0].body["stream"] is True


@pytest.mark.parametrize("mode", [None, True])
def test_generate_stream_incremental_detected_or_declared(mode):
    async def body(c):
        return await _collect(c.generate_stream(REQ))
    events, _ = run(_with({("POST", "/generate"):
                           Reply.fixture("generate_stream_incremental.sse")}, body,
                          incremental_output=mode))
    # a prefix check alone would read the repeated " is" as an empty cumulative delta
    assert [e.text for e in events] == [" is", " is", " it", "?"]
    assert "".join(e.text for e in events) == " is is it?"
    assert [e.output_ids for e in events] == [[314], [314], [357], [47, 2]]


def test_generate_stream_error_chunk_after_a_token():
    async def body(c):
        got = []
        with pytest.raises(WorkerStreamError) as info:
            async for event in c.generate_stream(REQ):
                got.append(event.text)
        return got, info.value
    (got, err), _ = run(_with({("POST", "/generate"):
                               Reply.fixture("generate_stream_error.sse")}, body))
    assert got == [" Paris"]
    assert err.message == "The request was aborted: KV cache pool is full"
    assert (err.error_type, err.code, err.retryable) == ("ServiceUnavailable", 503, True)
    assert err.bytes_received is True and err.retry_safe is False


def test_generate_stream_error_before_first_token_is_retry_safe():
    async def body(c):
        with pytest.raises(WorkerStreamError) as info:
            await _collect(c.generate_stream(REQ))
        return info.value
    err, _ = run(_with({("POST", "/generate"):
                        Reply.fixture("generate_stream_error_first.sse")}, body))
    assert err.message.startswith("Input length (9000 tokens)")
    assert err.bytes_received is False and err.retryable is None and err.retry_safe is True


def test_connection_closed_mid_stream():
    async def body(c):
        got = []
        with pytest.raises(WorkerStreamError) as info:
            async for event in c.generate_stream(REQ):
                got.append(event.text)
        return got, info.value
    (got, err), _ = run(_with({("POST", "/generate"): Reply.fixture(
        "generate_stream.sse", close_after_events=2)}, body))
    assert got == [" Paris", "."]
    assert err.bytes_received is True and err.retry_safe is False


def test_http_errors_carry_status_message_and_retry_after():
    async def body(c):
        errors = []
        for call in (lambda: c.generate(REQ), lambda: c.chat_completions({"messages": []}),
                     lambda: c.health()):
            with pytest.raises(WorkerHTTPError) as info:
                await call()
            errors.append(info.value)
        return errors
    routes = {
        ("POST", "/generate"): Reply.fixture("generate_error_400.json", status=400),
        ("POST", "/v1/chat/completions"): Reply.fixture("openai_error_400.json", status=400),
        ("GET", "/health"): Reply.fixture("health_503.json", status=503,
                                          headers={"retry-after": "7"}),
    }
    (native, openai, health), _ = run(_with(routes, body))
    assert native.status == 400 and native.message.startswith("Input length (9000 tokens) exceeds")
    assert native.retry_safe is False
    assert (openai.status, openai.message, openai.error_type) == (
        400, "max_tokens must be positive", "BadRequestError")
    assert (health.status, health.message, health.retry_after) == (503, "Server is not ready", 7.0)
    assert health.retry_safe is True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_nothing_listening_is_a_connect_error():
    async def body():
        async with SGLangClient(f"http://127.0.0.1:{_free_port()}") as c:
            with pytest.raises(WorkerConnectError) as info:
                await c.generate(REQ)
            return info.value
    err = run(body())
    assert err.bytes_received is False and err.retry_safe is True


def test_slow_worker_times_out():
    async def body(c):
        with pytest.raises(WorkerTimeout) as first:
            await c.generate(REQ)
        with pytest.raises(WorkerTimeout) as streamed:
            await _collect(c.generate_stream(REQ))
        return first.value, streamed.value
    (err, streamed), _ = run(_with(
        {("POST", "/generate"): Reply.fixture("generate.json", delay_s=1.0)}, body,
        timeouts=ClientTimeouts(read=0.2)))
    assert (err.phase, err.bytes_received, err.retry_safe) == ("read", False, True)
    assert streamed.phase == "read" and streamed.bytes_received is False


def test_chat_non_stream_adds_spec_details_and_keeps_raw_bytes():
    async def body(c):
        return await c.chat_completions({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    result, server = run(_with({("POST", "/v1/chat/completions"): Reply.fixture("chat.json")}, body))
    assert result.raw == fixture_bytes("chat.json")
    assert result.parsed.choices[0].message.content == "The capital of France is Paris."
    assert server.received[0].body == {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                       "stream": False, "return_spec_tokens_details": True}


def test_chat_stream_yields_deltas_sglext_and_usage_chunks():
    async def body(c):
        return await _collect(c.chat_completions_stream({"model": "m", "messages": []}))
    chunks, server = run(_with({("POST", "/v1/chat/completions"):
                                Reply.fixture("chat_stream.sse")}, body))
    contents = [ch.parsed.choices[0].delta.content for ch in chunks if ch.parsed.choices]
    assert contents == ["", "The capital", " is Paris.", None]
    assert chunks[3].parsed.choices[0].finish_reason == "stop"
    sglext_chunk, usage_chunk = chunks[4].parsed, chunks[5].parsed
    assert sglext_chunk.choices == [] and spec_stats_from_sglext(sglext_chunk.sglext).verify_ct == 3
    assert usage_chunk.usage is not None and usage_chunk.usage.completion_tokens == 6
    assert chunks[1].raw.startswith(b'{"id":"chatcmpl-7e2a"')
    sent = server.received[0].body
    assert (sent["stream"], sent["return_spec_tokens_details"], sent["stream_options"]) == (
        True, True, {"include_usage": True})


def test_chat_stream_error_chunk():
    async def body(c):
        with pytest.raises(WorkerStreamError) as info:
            await _collect(c.chat_completions_stream({"messages": []}))
        return info.value
    err, _ = run(_with({("POST", "/v1/chat/completions"):
                        Reply.fixture("chat_stream_error.sse")}, body))
    assert (err.message, err.error_type, err.code) == (
        "Internal server error: worker crashed", "InternalServerError", 500)
    assert err.bytes_received is True


def test_completions_both_modes():
    async def body(c):
        full = await c.completions({"prompt": "count:"}, spec_details=False)
        return full
    full, server = run(_with({("POST", "/v1/completions"): Reply.fixture("completion.json")}, body))
    assert full.parsed.choices[0].text == " 1, 2, 3, 4"
    assert "return_spec_tokens_details" not in server.received[0].body

    async def streamed(c):
        return await _collect(c.completions_stream({"prompt": "count:"}))
    chunks, _ = run(_with({("POST", "/v1/completions"): Reply.fixture("completion_stream.sse")},
                          streamed))
    assert "".join(ch.parsed.choices[0].text for ch in chunks if ch.parsed.choices) == " 1, 2, 3"
    assert spec_stats_from_sglext(chunks[3].parsed.sglext).accept_length == 3.0
    assert chunks[4].parsed.usage.total_tokens == 10


def test_control_endpoints_and_info_fallbacks():
    async def body(c):
        await c.health()
        await c.abort("rid-9")
        return await c.loads(), await c.server_info(), await c.model_info()
    routes = {
        ("GET", "/health"): Reply(body=b""),
        ("POST", "/abort_request"): Reply(body=b""),
        ("GET", "/v1/loads"): Reply.fixture("loads.json"),
        ("GET", "/get_server_info"): Reply.fixture("server_info.json"),  # old alias only
        ("GET", "/model_info"): Reply.fixture("model_info.json"),
    }
    (loads, info, model), server = run(_with(routes, body))
    assert loads.loads[0].num_running_reqs == 3
    assert info.speculative_algorithm == "EAGLE3" and model.model_type == "llama"
    assert [(r.method, r.path) for r in server.received] == [
        ("GET", "/health"), ("POST", "/abort_request"),
        ("GET", "/v1/loads?include=core%2Cmemory%2Cspec%2Cqueues"),
        ("GET", "/server_info"), ("GET", "/get_server_info"), ("GET", "/model_info")]
    assert server.received[1].body == {"rid": "rid-9"}


def test_unopened_client_says_how_to_fix():
    with pytest.raises(RuntimeError, match="call `await open\\(\\)` first"):
        run(SGLangClient("http://127.0.0.1:1").health())
