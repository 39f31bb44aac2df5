"""Load points: closed-loop concurrency (``c4``: 4 clients, each sends its next request when the
previous answer ends) and open-loop Poisson arrivals (``p0.5``: 0.5 requests/s on average, seeded
exponential gaps, each request sent at its time whatever is still in flight)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from bench.workloads import WorkItem
from replay.sim import Load


class LoadPoint(Load):
    """A load point of the serving benchmark: replay's ``Load`` (replay/sim.py: the same labels and
    the same seeded Poisson gaps, so a replay reproduces a benchmark cell), without ``trace``, which needs
    recorded arrival times."""

    @classmethod
    def parse(cls, text: str) -> LoadPoint:
        try:
            point = Load.parse(text)
        except ValueError:
            point = None
        if point is None or point.label == "trace":  # recorded arrival times: replay only
            raise ValueError(f"--loads: {text!r} is not a load point; use cN (closed loop, N concurrent "
                             "clients, e.g. c4) or pR (Poisson arrivals at R requests/s, e.g. p0.5)")
        return cls(point.label, concurrency=point.concurrency, rate=point.rate)


Send = Callable[[WorkItem, float], Awaitable[object]]


async def drive(point: LoadPoint, items: list[WorkItem], send: Send, seed: int) -> float:
    """Send every item under ``point``; ``send(item, start_offset_s)``. Returns the wall time (s)."""
    t0 = time.perf_counter()
    if point.concurrency is not None:
        queue = list(items)

        async def client() -> None:
            while queue:
                item = queue.pop(0)
                await send(item, time.perf_counter() - t0)

        await asyncio.gather(*(client() for _ in range(min(point.concurrency, len(items)))))
    else:
        tasks = []
        for item, at in zip(items, point.arrivals(len(items), seed)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(item, time.perf_counter() - t0)))
        await asyncio.gather(*tasks)
    return time.perf_counter() - t0
