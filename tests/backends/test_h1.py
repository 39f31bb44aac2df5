"""backends.sglang.h1: the gateway's keep-alive JSON client, against a scripted raw-socket server."""

from __future__ import annotations

import asyncio
import json

import pytest

from backends.sglang.client import ClientTimeouts, SGLangClient
from backends.sglang.errors import WorkerConnectError, WorkerHTTPError, WorkerStreamError, WorkerTimeout
from backends.sglang.h1 import H1Pool

CHAT = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def _answer(status: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: application/json\r\n" + extra +
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class Scripted:
    """Answers each request with ``answer(n, request_bytes)``: the answer's bytes, None (close without a byte), or a
    list of steps (bytes: write them; a float: wait that many seconds; None: close); counts connections and
    requests."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                out = await self.answer(len(self.requests), body)
                for step in out if isinstance(out, list) else [out]:
                    if step is None:
                        writer.close()
                        return
                    if isinstance(step, float):
                        await asyncio.sleep(step)
                        continue
                    writer.write(step)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        for w in self.writers:
            w.close()
        self.server.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_keep_alive_reuses_one_connection_and_sends_the_body():
    async def answer(n, body):
        return _answer("200 OK", json.dumps({"n": n, "echo": json.loads(body)}).encode())

    async def main():
        server = Scripted(answer)
        async with server as url:
            pool = H1Pool(url, connect_s=2, read_s=5)
            out = [json.loads((await pool.post("/v1/chat/completions", b'{"a": %d}' % i)).body) for i in range(3)]
            pool.close()
        assert out == [{"n": 1, "echo": {"a": 0}}, {"n": 2, "echo": {"a": 1}}, {"n": 3, "echo": {"a": 2}}]
        assert server.connections == 1
        assert server.requests[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    run(main())


def test_a_connection_the_worker_closed_is_replaced():
    async def answer(n, body):
        return None if n == 2 else _answer("200 OK", b'{"n": %d}' % n)  # closes instead of answering #2

    async def main():
        server = Scripted(answer)
        async with server as url:
            pool = H1Pool(url, connect_s=2, read_s=5)
            first = await pool.post("/p", b"{}")
            second = await pool.post("/p", b"{}")  # reused connection dies unanswered: retried fresh
            pool.close()
        assert (first.body, second.body) == (b'{"n": 1}', b'{"n": 3}')
        assert server.connections == 2
    run(main())


def test_read_timeout_and_refused_connection_are_typed():
    async def answer(n, body):
        await asyncio.sleep(5)
        return _answer("200 OK", b"{}")

    async def main():
        server = Scripted(answer)
        async with server as url:
            pool = H1Pool(url, connect_s=2, read_s=0.2)
            with pytest.raises(WorkerTimeout) as timeout:
                await pool.post("/p", b"{}")
            assert timeout.value.phase == "read" and timeout.value.retry_safe
            assert pool._idle == []  # the timed-out connection is not kept
        refused = H1Pool(url, connect_s=2, read_s=1)
        with pytest.raises(WorkerConnectError, match="ConnectError"):
            await refused.post("/p", b"{}")
    run(main())


def test_cancelled_request_closes_its_connection():
    async def answer(n, body):
        if n == 1:
            await asyncio.sleep(5)
        return _answer("200 OK", b'{"n": %d}' % n)

    async def main():
        server = Scripted(answer)
        async with server as url:
            pool = H1Pool(url, connect_s=2, read_s=10)
            task = asyncio.ensure_future(pool.post("/p", b"{}"))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert pool._idle == []
            later = await pool.post("/p", b"{}")
            pool.close()
        assert later.body == b'{"n": 2}' and server.connections == 2
    run(main())


def test_client_fast_path_parses_answers_and_maps_worker_errors():
    async def answer(n, body):
        if n == 1:
            return _answer("200 OK", json.dumps(CHAT).encode())
        return _answer("503 Service Unavailable", b'{"error": {"message": "busy", "type": "overloaded"}}',
                       b"retry-after: 3\r\n")

    async def main():
        server = Scripted(answer)
        async with server as url:
            async with SGLangClient(url, fast_json=True) as client:
                ok = await client.chat_completions({"model": "m", "messages": []})
                with pytest.raises(WorkerHTTPError) as err:
                    await client.chat_completions({"model": "m", "messages": []})
        assert ok.raw == json.dumps(CHAT).encode() and ok.parsed.usage.completion_tokens == 1
        assert (err.value.status, err.value.message, err.value.retry_after) == (503, "busy", 3.0)
        sent = json.loads(server.requests[0].split(b"\r\n\r\n", 1)[1])
        assert sent == {"model": "m", "messages": [], "stream": False, "return_spec_tokens_details": True}
    run(main())


CHUNK = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
         "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}


def _sse(*payloads: bytes) -> bytes:
    body = b"".join(b"data: " + p + b"\n\n" for p in payloads)
    return _answer("200 OK", body).replace(b"application/json", b"text/event-stream")


@pytest.mark.parametrize("fast_json", [False, True])
def test_both_paths_resend_once_on_a_connection_dropped_before_the_answer(fast_json):
    """Streaming and the JSON path, on httpx and on H1Pool: a reused keep-alive connection the worker closes
    unanswered (as uvicorn does after 5 idle seconds, racing the next request) is retried once on a new
    connection; a second drop in a row is the worker's fault, typed retry-safe."""
    async def answer(n, body):
        if n in (2, 5, 7, 8):
            return None  # read the request, close without a byte
        if json.loads(body).get("stream"):
            return _sse(json.dumps(CHUNK).encode(), b"[DONE]")
        return _answer("200 OK", json.dumps(CHAT).encode())

    async def main():
        server = Scripted(answer)
        async with server as url:
            async with SGLangClient(url, fast_json=fast_json) as client:
                stream = {"model": "m", "messages": [], "stream": True}
                first = [c.parsed.choices[0].delta.content async for c in client.chat_completions_stream(stream)]
                again = [c.parsed.choices[0].delta.content async for c in client.chat_completions_stream(stream)]
                plain = await client.chat_completions({"model": "m", "messages": []})  # #4 answered
                retried = await client.chat_completions({"model": "m", "messages": []})  # #5 dropped, #6 answered
                with pytest.raises(WorkerConnectError) as err:  # #7 and #8 dropped
                    _ = [c async for c in client.chat_completions_stream(stream)]
        assert first == again == ["hi"] and len(server.requests) == 8
        assert plain.parsed.usage.completion_tokens == retried.parsed.usage.completion_tokens == 1
        assert err.value.retry_safe and "RemoteProtocolError" in err.value.message
    run(main())


def _chunked_head() -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(content: str) -> bytes:
    chunk = {**CHUNK, "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _contents(client: SGLangClient, got: list[str]):
    async def read():
        async for c in client.chat_completions_stream({"model": "m", "messages": [], "stream": True}):
            got.extend(choice.delta.content for choice in c.parsed.choices)
    return read()


def test_a_stream_arrives_piece_by_piece_and_its_connection_is_reused():
    """H1Pool's streamed answer: events split anywhere across chunks (mid-line, CRLF line ends) come out whole
    and in order, each as soon as its chunk arrived; a complete answer's connection serves the next one."""
    first, second = _event("a"), _event("b").replace(b"\n", b"\r\n")

    async def answer(n, body):
        return [_chunked_head(), _chunk(first[:17]), 0.05, _chunk(first[17:] + second[:5]), 0.05,
                _chunk(second[5:] + b"data: [DONE]\n\n"), b"0\r\n\r\n"]

    async def main():
        server = Scripted(answer)
        async with server as url:
            async with SGLangClient(url, fast_json=True) as client:
                one, two = [], []
                await _contents(client, one)
                await _contents(client, two)
        assert one == two == ["a", "b"] and server.connections == 1
    run(main())


def test_a_stream_broken_or_silent_mid_answer_is_typed_and_its_connection_dropped():
    async def answer(n, body):
        if n == 1:  # the worker dies after one event
            return [_chunked_head(), _chunk(_event("a")), 0.05, None]
        if n == 2:  # the worker stalls after one event
            return [_chunked_head(), _chunk(_event("a")), 5.0]
        if n == 3:  # the worker dies after the status line, before any event: nothing reached the caller
            return [_chunked_head(), 0.05, None]
        return [_chunked_head(), _chunk(_event("z") + b"data: [DONE]\n\n"), b"0\r\n\r\n"]

    async def main():
        server = Scripted(answer)
        async with server as url:
            timeouts = ClientTimeouts(read=0.3)
            async with SGLangClient(url, fast_json=True, timeouts=timeouts) as client:
                broken, silent, empty, later = [], [], [], []
                with pytest.raises(WorkerStreamError) as err:
                    await _contents(client, broken)
                assert broken == ["a"] and err.value.bytes_received and not err.value.retry_safe
                with pytest.raises(WorkerTimeout) as stalled:
                    await _contents(client, silent)
                assert silent == ["a"] and stalled.value.phase == "read" and stalled.value.bytes_received
                with pytest.raises(WorkerStreamError) as unstarted:
                    await _contents(client, empty)
                assert empty == [] and unstarted.value.retry_safe  # safe to send elsewhere
                await _contents(client, later)
        assert later == ["z"] and server.connections == 4  # no broken connection was reused
    run(main())


def test_a_reader_that_leaves_mid_stream_closes_its_connection():
    async def answer(n, body):
        if n == 1:
            return [_chunked_head(), _chunk(_event("a")), 5.0]
        return [_chunked_head(), _chunk(_event("b") + b"data: [DONE]\n\n"), b"0\r\n\r\n"]

    async def main():
        server = Scripted(answer)
        async with server as url:
            async with SGLangClient(url, fast_json=True) as client:
                stream = client.chat_completions_stream({"model": "m", "messages": [], "stream": True})
                first = await anext(stream)
                await stream.aclose()  # the client went away
                assert client._h1 is not None and client._h1._idle == []
                later = []
                await _contents(client, later)
                assert len(client._h1._idle) == 1  # only the complete answer's connection is kept
        assert first.parsed.choices[0].delta.content == "a" and later == ["b"] and server.connections == 2
    run(main())


def test_a_streamed_error_status_is_typed_with_the_workers_message():
    async def answer(n, body):
        return _answer("429 Too Many Requests", b'{"error": {"message": "queue full", "type": "overloaded"}}',
                       b"retry-after: 2\r\n")

    async def main():
        server = Scripted(answer)
        async with server as url:
            async with SGLangClient(url, fast_json=True) as client:
                with pytest.raises(WorkerHTTPError) as err:
                    await _contents(client, [])
                with pytest.raises(WorkerHTTPError):
                    await _contents(client, [])
        assert (err.value.status, err.value.message, err.value.retry_after) == (429, "queue full", 2.0)
        assert server.connections == 1  # an error answer read whole keeps its connection
    run(main())


def test_a_reader_that_falls_behind_pauses_the_socket_and_loses_nothing():
    """Flow control: a stream's reader far behind (H1Stream.PAUSE_AT pieces buffered) pauses reading from the
    worker's socket, and resumes once it caught up; every event arrives, in order."""
    async def answer(n, body):
        return [_chunked_head(), *(_chunk(_event(str(i))) for i in range(200)), _chunk(b"data: [DONE]\n\n"),
                b"0\r\n\r\n"]

    async def main():
        server = Scripted(answer)
        async with server as url:
            pool = H1Pool(url, connect_s=2, read_s=5)
            async with pool.stream("/v1/chat/completions", b"{}") as response:
                deadline = asyncio.get_running_loop().time() + 10
                while not response._paused and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.01)  # not reading: the worker's bytes pile up
                paused = response._paused
                lines = [line async for line in response.lines()]
            pool.close()
        got = [json.loads(line[6:])["choices"][0]["delta"]["content"] for line in lines if line.startswith("data: {")]
        assert paused and got == [str(i) for i in range(200)] and not response._paused
    run(main())
