"""Noticing a client that goes away while a non-streaming answer is still being computed.

Shared by both ASGI apps (the gateway and ``specgate worker``). Uvicorn does not cancel a handler
whose client disconnected; it only answers ``http.disconnect`` on the ASGI ``receive`` channel.
``unless_client_leaves`` watches that channel in at most one extra task per request (cancelled as soon as
the answer is there) and, on a disconnect, cancels the waiting handler so its work stops: the gateway's
``dispatch`` then aborts the worker's request, the worker's bridge aborts the engine request. Streams
do not need this: a stream's disconnect surfaces at its next write.

The watcher starts ``WATCH_AFTER_S`` into the wait, from a timer: an answer that comes sooner (a refusal, a
cached or tiny answer) never pays for a task, and a client that left is noticed at most that much later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
WATCH_AFTER_S = 0.01  # work a client that left can still cost; a whole answer this quick starts no watcher
Receive = Callable[[], Awaitable[Any]]


async def _until_disconnect(receive: Receive) -> None:
    # the body was read already: the next message is the disconnect (or the end of the response)
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(receive: Receive, answer: Awaitable[T]) -> tuple[bool, T | None]:
    """``(True, result)`` when ``answer`` finished; ``(False, None)`` when the client disconnected
    first (``answer`` was cancelled inside this task). Other cancellations propagate unchanged."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _until_disconnect(receive)
        gone = True
        task.cancel()

    loop = asyncio.get_running_loop()
    watcher: asyncio.Task | None = None

    def start() -> None:
        nonlocal watcher
        watcher = loop.create_task(watch())

    timer = loop.call_later(WATCH_AFTER_S, start)
    try:
        return True, await answer
    except asyncio.CancelledError:
        if not gone or task.uncancel() > 0:  # someone else cancelled us too (shutdown): honour it
            raise
        return False, None
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.cancel()
