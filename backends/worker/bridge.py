"""asyncio <-> engine thread.

The engine runs its step loop on its own thread and calls ``on_output`` from there after every round;
``EngineBridge.events`` turns that into an async iterator with ``loop.call_soon_threadsafe`` so the
event loop never blocks on the model. Leaving the iterator early (client disconnect, cancellation)
aborts the engine request, freeing its slot and KV reservation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from backends.engine.engine import Engine
from backends.engine.scheduler import AdmissionError
from backends.engine.types import GenerateRequest, RequestOutput
from backends.worker.errors import BadRequest, Overloaded
from backends.worker.metrics import WorkerMetrics


class EngineBridge:
    def __init__(self, engine: Engine, metrics: WorkerMetrics, max_queued_requests: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.active: set[str] = set()
        self.last_output_at = 0.0  # time.monotonic() of the latest engine event (health shortcut)

    def _admit(self, request: GenerateRequest, queue: asyncio.Queue[RequestOutput],
               bypass_queue_limit: bool) -> None:
        """Submit or refuse at once: 429 when the waiting queue is full (``max_queued_requests``
        beyond the free running slots), 400 when the request can never run.

        Checked before ``submit`` with no await in between, so concurrent handlers cannot overshoot.
        """
        load = self.engine.load()
        # waiting requests that a free running slot will take at the next turn are not queued
        queued = load.num_waiting_reqs - max(0, load.max_running_requests - load.num_running_reqs)
        if queued >= self.max_queued_requests and not bypass_queue_limit:
            raise Overloaded(f"the worker's waiting queue is full ({load.num_waiting_reqs} waiting, "
                             f"{load.num_running_reqs} running); retry later or on another worker")
        if request.rid in self.active:
            raise BadRequest(f"rid {request.rid!r} is already in use by a running request; send a unique rid",
                             "rid")
        loop = asyncio.get_running_loop()
        metrics = self.metrics

        def on_output(out: RequestOutput) -> None:  # engine thread
            self.last_output_at = time.monotonic()
            metrics.observe(out)
            loop.call_soon_threadsafe(queue.put_nowait, out)

        try:
            self.engine.submit(request, on_output)
        except (AdmissionError, ValueError) as exc:
            raise BadRequest(str(exc), "input_ids") from exc
        self.active.add(request.rid)
        metrics.submitted(request.rid, len(request.input_ids))

    def events(self, request: GenerateRequest, *, bypass_queue_limit: bool = False
               ) -> AsyncIterator[RequestOutput]:
        """Submit now (refusals raise here, before any response starts), then iterate every engine
        event of ``request``, ending with the finished one."""
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._admit(request, queue, bypass_queue_limit)
        return self._drain(request.rid, queue)

    async def _drain(self, rid: str, queue: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                out = await queue.get()
                if out.finished:  # released before the last yield: a consumer may stop right there
                    finished = True
                    self.active.discard(rid)
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.active.discard(rid)
                self.engine.abort(rid)

    async def complete(self, request: GenerateRequest, *, bypass_queue_limit: bool = False) -> RequestOutput:
        async for out in self.events(request, bypass_queue_limit=bypass_queue_limit):
            if out.finished:
                return out
        raise RuntimeError("engine stream ended without a finished event")  # pragma: no cover

    async def ping(self) -> None:
        """Return once the engine's step loop has taken an item from its inbox (no model work)."""
        loop = asyncio.get_running_loop()
        turned: asyncio.Future[None] = loop.create_future()
        self.engine.ping(lambda: loop.call_soon_threadsafe(turned.set_result, None))
        await turned

    def abort(self, rid: str) -> bool:
        """Abort a request by rid; False if the worker knows no such running request."""
        if rid not in self.active:
            return False
        self.engine.abort(rid)
        return True
