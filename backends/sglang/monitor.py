"""The I/O half of worker pools: an async loop that polls every worker and feeds the pools.

Per round and per distinct worker URL (one worker may serve several pools, e.g. specgate's embedded
worker with per-request speculation): ``/health``; when healthy, ``/v1/loads``; and, when the
identity is older than ``identity_interval_s`` (or unknown), ``/server_info`` + ``/model_info``. A
worker whose backoff is running is skipped (``WorkerPool.needs_probe``). Results go to every pool
that lists the URL. The monitor owns one ``SGLangClient`` per URL; the gateway reuses them through
``client(url)`` for its requests, so one connection pool per worker serves both.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import structlog

from backends.sglang.client import ClientTimeouts, SGLangClient
from backends.sglang.errors import WorkerError
from backends.sglang.pair import PairIdentity
from backends.sglang.pool import WorkerPool

log = structlog.get_logger(__name__)


class PoolMonitor:
    """``await start()`` runs one full round (so pools are usable at once), then polls every
    ``interval_s``; ``await stop()`` ends the loop and closes the clients. ``on_round`` is called after
    every round (the gateway reads the workers' loads then)."""

    def __init__(self, pools: Sequence[WorkerPool], *, interval_s: float = 2.0,
                 identity_interval_s: float = 30.0, timeouts: ClientTimeouts = ClientTimeouts(),
                 clock: Callable[[], float] = time.monotonic,
                 client_factory: Callable[[str], SGLangClient] | None = None,
                 on_round: Callable[[], None] | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.pools = list(pools)
        self.interval_s = interval_s
        self.identity_interval_s = identity_interval_s
        self.clock = clock
        factory = client_factory or (lambda url: SGLangClient(url, timeouts=timeouts))
        urls = dict.fromkeys(url for pool in self.pools for url in pool.workers)
        self.clients: dict[str, SGLangClient] = {url: factory(url) for url in urls}
        self.on_round = on_round
        self._task: asyncio.Task[None] | None = None

    def client(self, url: str) -> SGLangClient:
        return self.clients[url]

    def _pools_of(self, url: str) -> list[WorkerPool]:
        return [pool for pool in self.pools if url in pool.workers]

    async def start(self) -> None:
        for client in self.clients.values():
            await client.open()
        await self.check_once()
        self._task = asyncio.create_task(self._loop(), name="specgate-pool-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for client in self.clients.values():
            await client.aclose()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_once()
            except Exception:  # noqa: BLE001 - the monitor must outlive any one bad round
                log.exception("pool_monitor_round_failed")

    async def check_once(self) -> None:
        """One round over every worker, concurrently."""
        await asyncio.gather(*(self._check(url) for url in self.clients))
        if self.on_round is not None:
            self.on_round()

    async def _check(self, url: str) -> None:
        pools = self._pools_of(url)
        now = self.clock()
        if not any(pool.needs_probe(url, now) for pool in pools):
            return
        client = self.clients[url]
        try:
            await client.health()
            loads = await client.loads()
            identity = None
            if self._identity_stale(url, now):
                server = await client.server_info()
                model = await client.model_info()
                identity = PairIdentity.from_info(server, model)
        except WorkerError as exc:
            now = self.clock()
            log.warning("worker_check_failed", url=url, error=str(exc))
            for pool in pools:
                pool.report_failure(url, now, str(exc))
            return
        now = self.clock()
        for pool in pools:
            pool.report_success(url, now)
            pool.record_load(url, loads, now)
            if identity is not None:
                pool.record_identity(url, identity, now)

    def _identity_stale(self, url: str, now: float) -> bool:
        for pool in self._pools_of(url):
            state = pool.workers[url]
            if state.identity_at is None or now - state.identity_at >= self.identity_interval_s:
                return True
        return False
