"""Noticing a client that goes away while a non-streaming answer is still being computed.

Shared by both ASGI apps (the gateway and ``specgate worker``). Uvicorn does not cancel a handler
whose client disconnected; it only answers ``http.disconnect`` on the ASGI ``receive`` channel.
``unless_client_leaves`` watches that channel in ONE extra task per request (cancelled as soon as the
answer is there) and, on a disconnect, cancels the waiting handler so its work stops: the gateway's
``dispatch`` then aborts the worker's request, the worker's bridge aborts the engine request. Streams
do not need this: a stream's disconnect surfaces at its next write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
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

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return True, await answer
    except asyncio.CancelledError:
        if not gone or task.uncancel() > 0:  # someone else cancelled us too (shutdown): honour it
            raise
        return False, None
    finally:
        watcher.cancel()
