"""A minimal HTTP/1.1 keep-alive client for the gateway's hot path: ``POST`` JSON, read the whole answer.

Why not httpx here: profiling the gateway under load from an instant worker showed httpx + httpcore +
anyio taking most of the gateway's CPU per request (URL merging, cookie jars, pool scans, anyio
checkpoints, two socket writes). This client does one ``transport.write`` per request and parses the
answer with ``httptools`` (uvicorn's parser, already a dependency), on a plain asyncio protocol.
It serves ``/v1/chat/completions`` and ``/v1/completions``, whole (``H1Pool.post``) or streamed
(``H1Pool.stream``: the body handed over as it arrives, for about a third of the gateway CPU per streamed answer
that httpx's streaming took, docs/runs/2026-12-06-resume/stream-cost.md); health, loads and aborts stay on httpx.

Semantics kept from the httpx path: the connect timeout bounds the TCP connect; the read timeout bounds
each wait for the next bytes of the answer; a refused or dropped connection before the status line is a
``WorkerConnectError`` (retry-safe), a timeout a ``WorkerTimeout``. A keep-alive connection the worker
closed while it sat idle is detected (the protocol saw ``connection_lost``) and never reused; one that
breaks before any answer byte on reuse is retried once on a fresh connection. A request cancelled
mid-flight (its client went away) closes its connection, which is never returned to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httptools

from backends.sglang.errors import WorkerConnectError, WorkerStreamError, WorkerTimeout


class H1Response:
    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers  # lower-case names
        self.body = body


class H1Stream:
    """An answer read as it arrives (``H1Pool.stream``): ``status`` and ``headers``, then ``lines()`` or
    ``read()``. A failure after the status line (the connection broke, no byte for ``read_s``) is raised by
    the read that meets it, as the ``WorkerError`` the whole-answer path raises."""

    __slots__ = ("status", "headers", "complete", "_chunks", "_error", "_wake", "_transport", "_paused")

    PAUSE_AT, RESUME_AT = 64, 16  # pieces buffered: a reader this far behind pauses the socket (flow control)

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.complete = False  # the whole answer arrived (the connection may be reused)
        self._chunks: deque[bytes] = deque()
        self._error: Exception | None = None
        self._wake: asyncio.Future[None] | None = None
        self._transport: asyncio.Transport | None = None
        self._paused = False

    def _push(self, data: bytes) -> None:
        self._chunks.append(data)
        if len(self._chunks) >= self.PAUSE_AT and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wakeup()

    def _wakeup(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _next(self) -> bytes | None:
        """The next piece of the body; None at its end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return None
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        if self._paused and len(self._chunks) <= self.RESUME_AT and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return self._chunks.popleft()

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while (data := await self._next()) is not None:
            parts.append(data)
        return b"".join(parts)

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines as they complete (``\n`` or ``\r\n`` ends a line; UTF-8)."""
        tail = b""
        while (data := await self._next()) is not None:
            *done, tail = (tail + data).split(b"\n")
            for line in done:
                yield line.rstrip(b"\r").decode()
        if tail:
            yield tail.rstrip(b"\r").decode()


class _Conn(asyncio.Protocol):
    """One keep-alive connection; at most one request in flight on it, answered whole (``waiter``) or as a
    stream (``stream``, its status line and headers through ``waiter``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.waiter: asyncio.Future | None = None
        self.stream: H1Stream | None = None
        self.received = False  # any byte of the current answer
        self.last_data = 0.0
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        self.last_data = time.monotonic()
        if self.waiter is None and self.stream is None:  # bytes nobody asked for: the connection is out of step
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(WorkerConnectError(self.url, f"RemoteProtocolError: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.stream is not None and self.waiter is None:  # mid-body: the stream's reader meets it
            self._fail(WorkerStreamError(self.url, "connection broke mid-stream: the worker disconnected",
                                         bytes_received=True))
        else:
            self._fail(WorkerConnectError(self.url, "RemoteProtocolError: server disconnected without "
                                          "sending a complete response"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        stream = self.stream
        if stream is not None:
            stream.status, stream.headers = self.parser.get_status_code(), self._headers
            waiter, self.waiter = self.waiter, None
            if waiter is not None and not waiter.done():
                waiter.set_result(stream)

    def on_body(self, body: bytes) -> None:
        stream = self.stream
        if stream is None:
            self._body.append(body)
        else:
            stream._push(body)

    def on_message_complete(self) -> None:
        keep = self.parser.should_keep_alive()
        stream = self.stream
        if stream is not None:
            self.stream = None
            stream.complete = True
            if not keep:
                self.close()
            stream._wakeup()
            return
        waiter, self.waiter = self.waiter, None
        response = H1Response(self.parser.get_status_code(), self._headers, b"".join(self._body))
        if not keep:
            self.close()
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    # own
    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
            return
        stream = self.stream
        if stream is not None and stream._error is None:
            stream._error = exc
            stream._wakeup()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def start(self, payload: bytes, stream: H1Stream | None = None) -> asyncio.Future:
        """Send one request; the future resolves to the whole ``H1Response``, or with ``stream`` to it once
        the status line and headers arrived."""
        assert self.transport is not None
        self._headers, self._body, self.received = {}, [], False
        self.stream = stream
        if stream is not None:
            stream._transport = self.transport
        self.last_data = time.monotonic()
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(payload)
        return self.waiter


class H1Pool:
    """Keep-alive connections to one worker (``base_url``: ``http://host:port``), reused LIFO."""

    def __init__(self, base_url: str, *, connect_s: float, read_s: float, max_idle: int = 64) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"H1Pool speaks plain http only, got {base_url!r}")
        self.url = base_url
        self.host, self.port = parts.hostname, parts.port or 80
        self._host_header = parts.netloc.encode("latin-1")
        self.connect_s, self.read_s, self.max_idle = connect_s, read_s, max_idle
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: _Conn(self.url), self.host, self.port),
                                             self.connect_s)
        except asyncio.TimeoutError:
            raise WorkerTimeout(self.url, "connect") from None
        except OSError as exc:
            raise WorkerConnectError(self.url, f"ConnectError: {exc}") from None
        return conn

    def _payload(self, path: str, body: bytes, headers: Mapping[str, str] | None = None) -> bytes:
        extra = b"".join(b"\r\n" + k.encode("latin-1") + b": " + v.encode("latin-1")
                         for k, v in headers.items()) if headers else b""
        return (b"POST " + path.encode("latin-1") + b" HTTP/1.1\r\nhost: " + self._host_header +
                b"\r\naccept: */*\r\ncontent-type: application/json" + extra + b"\r\ncontent-length: " +
                str(len(body)).encode() + b"\r\n\r\n" + body)

    async def post(self, path: str, body: bytes, headers: Mapping[str, str] | None = None) -> H1Response:
        """POST ``body``; ``headers``: extra request headers (the gateway's ``traceparent``)."""
        payload = self._payload(path, body, headers)
        while self._idle:
            conn = self._idle.pop()
            if conn.closed:
                continue
            try:
                return await self._exchange(conn, payload)
            except WorkerConnectError:
                if conn.received:
                    raise
                # the worker closed this idle connection as we reused it: once more on a fresh one
            break
        return await self._exchange(await self._connect(), payload)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, body: bytes, headers: Mapping[str, str] | None = None
                     ) -> AsyncIterator[H1Stream]:
        """POST ``body`` and hand over the answer as it arrives (its status and headers read). Leaving the block
        before the answer's end (the client went away, an error) closes the connection; a complete answer's
        connection is reused."""
        payload = self._payload(path, body, headers)
        conn: _Conn | None = None
        while self._idle:
            idle = self._idle.pop()
            if not idle.closed:
                conn = idle
                break
        response: H1Stream | None = None
        if conn is not None:
            try:
                response = await self._head(conn, payload)
            except WorkerConnectError:
                if conn.received:
                    raise
                # the worker closed this idle connection as we reused it: once more on a fresh one
        if response is None:
            conn = await self._connect()
            response = await self._head(conn, payload)
        assert conn is not None
        timer = asyncio.get_running_loop().call_later(self.read_s, self._check_stream, conn, response)
        try:
            yield response
        finally:
            timer.cancel()
            if not response.complete or conn.closed:
                if response._error is None:  # left mid-answer (ends the read-timeout checks too)
                    response._error = WorkerStreamError(self.url, "stream closed by the reader", bytes_received=True)
                conn.stream = None
                conn.close()  # never reuse
            elif len(self._idle) < self.max_idle:
                self._idle.append(conn)
            else:
                conn.close()

    async def _head(self, conn: _Conn, payload: bytes) -> H1Stream:
        """Send a streamed request on ``conn``; its answer once the status line and headers arrived."""
        waiter = conn.start(payload, H1Stream())
        timer = asyncio.get_running_loop().call_later(self.read_s, self._check_idle, conn, waiter)
        try:
            return await waiter
        except BaseException:
            conn.stream = None
            conn.close()
            raise
        finally:
            timer.cancel()

    def _check_stream(self, conn: _Conn, stream: H1Stream) -> None:
        """Read timeout of a streamed body: fail its reader when no byte came for ``read_s``; else wait on."""
        if stream.complete or stream._error is not None:
            return
        quiet = time.monotonic() - conn.last_data
        if stream._paused:  # the reader is behind, not the worker: wait on
            quiet = 0.0
        if quiet >= self.read_s:
            stream._error = WorkerTimeout(self.url, "read", bytes_received=True)
            stream._wakeup()
            conn.stream = None
            conn.close()
        else:
            asyncio.get_running_loop().call_later(self.read_s - quiet, self._check_stream, conn, stream)

    async def _exchange(self, conn: _Conn, payload: bytes) -> H1Response:
        waiter = conn.start(payload)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.read_s, self._check_idle, conn, waiter)
        try:
            response = await waiter
        except BaseException:
            conn.close()  # cancelled or failed mid-answer: never reuse
            raise
        finally:
            timer.cancel()
        if not conn.closed and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        elif not conn.closed:
            conn.close()
        return response

    def _check_idle(self, conn: _Conn, waiter: asyncio.Future[H1Response]) -> None:
        """Read timeout: fail the request when no byte came for ``read_s``; else wait on."""
        if waiter.done():
            return
        quiet = time.monotonic() - conn.last_data
        if quiet >= self.read_s:
            conn.waiter = None
            waiter.set_exception(WorkerTimeout(self.url, "read", bytes_received=False))
            conn.close()
        else:
            asyncio.get_running_loop().call_later(self.read_s - quiet, self._check_idle, conn, waiter)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
