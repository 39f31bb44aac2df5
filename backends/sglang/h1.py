"""A minimal HTTP/1.1 keep-alive client for the gateway's hot path: ``POST`` JSON, read the whole answer.

Why not httpx here: profiling the gateway under load from an instant worker showed httpx + httpcore +
anyio taking most of the gateway's CPU per request (URL merging, cookie jars, pool scans, anyio
checkpoints, two socket writes). This client does one ``transport.write`` per request and parses the
answer with ``httptools`` (uvicorn's parser, already a dependency), on a plain asyncio protocol.
It serves only non-streaming ``/v1/chat/completions`` and ``/v1/completions``; streaming, health,
loads and aborts stay on httpx.

Semantics kept from the httpx path: the connect timeout bounds the TCP connect; the read timeout bounds
each wait for the next bytes of the answer; a refused or dropped connection before the status line is a
``WorkerConnectError`` (retry-safe), a timeout a ``WorkerTimeout``. A keep-alive connection the worker
closed while it sat idle is detected (the protocol saw ``connection_lost``) and never reused; one that
breaks before any answer byte on reuse is retried once on a fresh connection. A request cancelled
mid-flight (its client went away) closes its connection, which is never returned to the pool.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

import httptools

from backends.sglang.errors import WorkerConnectError, WorkerTimeout


class H1Response:
    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers  # lower-case names
        self.body = body


class _Conn(asyncio.Protocol):
    """One keep-alive connection; at most one request in flight on it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.waiter: asyncio.Future[H1Response] | None = None
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
        if self.waiter is None:  # bytes nobody asked for: the connection is out of step
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(WorkerConnectError(self.url, f"RemoteProtocolError: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(WorkerConnectError(self.url, "RemoteProtocolError: server disconnected without "
                                      "sending a complete response"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        waiter, self.waiter = self.waiter, None
        response = H1Response(self.parser.get_status_code(), self._headers, b"".join(self._body))
        if not self.parser.should_keep_alive():
            self.close()
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    # own
    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def start(self, payload: bytes) -> asyncio.Future[H1Response]:
        assert self.transport is not None
        self._headers, self._body, self.received = {}, [], False
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
