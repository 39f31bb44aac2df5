"""What one request holds while it lives, given back in one place (``Holds.release``), and the time it
spends awaiting workers (``Stopwatch``). Both belong to the request's owner, ``gateway.lifecycle.serve``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from backends.sglang.errors import WorkerError, WorkerHTTPError
from policies.decide import Decision, exploration_key

if TYPE_CHECKING:
    from gateway.limits import RouteLimiter
    from gateway.stages import Admitted
    from gateway.state import GatewayState


class Stopwatch:
    """Seconds spent awaiting workers (the rest of a request's time is the gateway's own overhead):
    ``with waited:`` around each await. A plain context manager, not a generator one: the relay enters it
    once per stream chunk."""

    __slots__ = ("seconds", "_started")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._started


class Holds:
    """What one request holds, each taken by one stage and all given back by ``release`` (called once,
    from ``serve``'s ``finally``): the route's admission reservation, the in-flight count the policy sees
    (with the request's mean concurrency over its life), its exploration slot, and its worker slot."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.limiter: RouteLimiter | None = None
        self.reserved_tokens = 0
        self.joined: tuple[float, float] | None = None  # (monotonic time, busy area) when counted
        self.exploring: str | None = None
        self.worker: tuple[Any, str, str] | None = None  # (backend, pool, url) of the acquired worker slot
        self.worker_failed = False

    def take_limits(self, admitted: Admitted) -> None:
        limiter = admitted.active.limiters.get(admitted.route)
        if limiter is not None:
            limiter.admit(admitted.cost_tokens)  # ApiError 429 when refused: nothing was taken then
            self.limiter, self.reserved_tokens = limiter, admitted.cost_tokens

    def count(self, decision: Decision) -> None:
        now = time.monotonic()
        self.state.change_in_flight(1, now)
        self.joined = (now, self.state.busy_area(now))
        self.exploring = exploration_key(decision)
        if self.exploring is not None:
            self.state.change_exploring(self.exploring, +1)

    def hold_worker(self, backend: Any, pool: str, url: str) -> None:
        self.worker = (backend, pool, url)

    def move_worker(self, backend: Any, pool: str, url: str) -> None:
        """A resume (``gateway/resume.py``) continues the answer on ``url``: the failed worker's slot is given back
        (without a success) and the new one held; the request stays one in flight."""
        if self.worker is not None:
            old_backend, old_pool, old_url = self.worker
            old_backend.give_back(old_pool, old_url)
        backend.take(pool, url)
        self.worker, self.worker_failed = (backend, pool, url), False

    def fail_worker(self, exc: WorkerError) -> None:
        """The worker failed mid-answer: counted against its health, not released as a success."""
        self.worker_failed = True
        if self.worker is not None and worker_fault(exc):
            backend, pool, url = self.worker
            backend.pools[pool].report_failure(url, time.monotonic(), str(exc))

    def release(self, used_tokens: int) -> float:
        """Give everything back; returns the mean concurrency the request ran at (itself included)."""
        mean = 1.0
        left = time.monotonic()
        if self.worker is not None:
            backend, pool_name, url = self.worker
            backend.give_back(pool_name, url, served_at=None if self.worker_failed else left)
        if self.joined is not None:
            joined_at, joined_area = self.joined
            if left > joined_at:
                mean = max(1.0, (self.state.busy_area(left) - joined_area) / (left - joined_at))
            self.state.change_in_flight(-1, left)
            if self.exploring is not None:
                self.state.change_exploring(self.exploring, -1)
        if self.limiter is not None:
            self.limiter.finish(max(0, self.reserved_tokens - used_tokens))
        return mean


def worker_fault(exc: WorkerError) -> bool:
    """Failures that count against a worker's health (not the request's own 4xx, not overload)."""
    return not isinstance(exc, WorkerHTTPError) or exc.status >= 500
