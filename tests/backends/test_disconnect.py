"""backends/disconnect.unless_client_leaves: a client that leaves cancels the wait; an answer quicker than
WATCH_AFTER_S never starts the watcher (no task, no read of the ASGI channel)."""

from __future__ import annotations

import asyncio

import pytest

from backends.disconnect import WATCH_AFTER_S, unless_client_leaves


class Channel:
    """An ASGI ``receive`` whose client leaves at once: every call is counted."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> dict:
        self.calls += 1
        return {"type": "http.disconnect"}


def test_a_quick_answer_never_reads_the_channel():
    async def main():
        channel = Channel()
        tasks = len(asyncio.all_tasks())
        result = await unless_client_leaves(channel, asyncio.sleep(0, result="answer"))
        await asyncio.sleep(WATCH_AFTER_S * 3)  # the cancelled timer must not start a watcher later
        return result, channel.calls, len(asyncio.all_tasks()) - tasks

    assert asyncio.run(main()) == ((True, "answer"), 0, 0)


def test_a_client_that_leaves_cancels_a_long_wait():
    async def main():
        channel = Channel()
        cancelled = asyncio.Event()

        async def long_answer():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        result = await asyncio.wait_for(unless_client_leaves(channel, long_answer()), 30)
        return result, channel.calls, cancelled.is_set()

    assert asyncio.run(main()) == ((False, None), 1, True)


def test_a_cancellation_from_elsewhere_propagates():
    async def main():
        async def never_leaves():
            await asyncio.sleep(60)
            return {"type": "http.disconnect"}

        waiting = asyncio.get_running_loop().create_task(unless_client_leaves(never_leaves, asyncio.sleep(60)))
        await asyncio.sleep(WATCH_AFTER_S * 3)  # the watcher is up and waiting on the channel
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return waiting.cancelled()

    assert asyncio.run(main()) is True
