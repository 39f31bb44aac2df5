"""Fixture replay server: a real HTTP/1.1 server on a free loopback port that answers each route
with a recorded SGLang body (``tests/fixtures/sglang``) byte for byte.

Plain asyncio streams, so a test can also make it misbehave the ways real workers do: close the
connection in the middle of a stream, or stall before answering. Every request it receives is kept
(method, path with query, JSON body) so tests can assert what the client sent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sglang"


def fixture_bytes(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


@dataclass
class Reply:
    """How to answer one route. ``events``: SSE events sent one chunk each (chunked encoding)."""

    status: int = 200
    body: bytes = b""
    events: list[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0  # before the status line
    close_after_events: int | None = None  # drop the connection after this many events

    @classmethod
    def fixture(cls, name: str, status: int = 200, **kw: Any) -> Reply:
        data = fixture_bytes(name)
        if name.endswith(".sse"):
            events = [part + b"\n\n" for part in data.split(b"\n\n") if part]
            return cls(status=status, events=events, **kw)
        return cls(status=status, body=data, **kw)


@dataclass
class Received:
    method: str
    path: str
    body: Any
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names


class ReplayServer:
    """``async with ReplayServer({("GET", "/health"): Reply(...)}) as server: server.url``. A route may also be
    answered by a function of the request's JSON body (a fake worker that answers what it was asked)."""

    def __init__(self, routes: dict[tuple[str, str], Reply | Callable[[Any], Reply]]) -> None:
        self.routes = routes
        self.received: list[Received] = []
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> ReplayServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._serve_one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        request_line = await reader.readline()
        if not request_line:
            return False
        method, target, _ = request_line.decode().split(" ", 2)
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        raw = await reader.readexactly(int(headers.get("content-length", "0")))
        self.received.append(Received(method, target, json.loads(raw) if raw else None, headers))
        path = target.split("?", 1)[0]
        reply = self.routes.get((method, path), Reply(status=404, body=b'{"detail":"Not Found"}'))
        if callable(reply):
            reply = reply(self.received[-1].body)
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        head = [f"HTTP/1.1 {reply.status} X"]
        extra = {"content-type": "application/json", **reply.headers}
        if reply.events is not None:
            extra["content-type"] = "text/event-stream"
            extra["transfer-encoding"] = "chunked"
        else:
            extra["content-length"] = str(len(reply.body))
        head += [f"{k}: {v}" for k, v in extra.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        if reply.events is None:
            writer.write(reply.body)
            await writer.drain()
            return True
        for i, event in enumerate(reply.events):
            if reply.close_after_events is not None and i >= reply.close_after_events:
                await writer.drain()
                return False  # drop the connection without the terminating chunk
            writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True
