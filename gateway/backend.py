"""The gateway's view of its workers: one ``WorkerPool`` per policy pool, one ``PoolMonitor`` over
all of them, the model catalog (served model names and context windows from ``/server_info``).

A ``Backend`` is built per pool topology (pool names, worker URLs, declared pairs). A policy reload
that keeps the topology keeps the Backend (and its health state); one that changes it builds a new
Backend, and the old one is closed once its in-flight requests are done.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time

import msgspec

import structlog

from backends.sglang.client import ClientTimeouts, SGLangClient
from backends.sglang.errors import WorkerError
from backends.sglang.monitor import PoolMonitor
from backends.sglang.pair import DRAFT_PARAM_ARGS, ExpectedPair
from backends.sglang.pool import PoolSnapshot, WorkerPool
from backends.sglang.transport import ShardedTransport
from backends.sglang.wire import ServerInfo
from policies.schema import DRAFT_PARAMS, Policy
from policies.snapshot import PoolState

log = structlog.get_logger("specgate.gateway")

# policy proposer -> SGLang's --speculative-algorithm
# (SUFFIX and HYBRID are specgate's embedded worker's; SGLang has no suffix decoding)
_ALGORITHM = {"none": "none", "ngram": "NGRAM", "suffix": "SUFFIX", "hybrid": "HYBRID",
              "draft_model": "STANDALONE", "standalone": "STANDALONE", "eagle": "EAGLE", "eagle3": "EAGLE3"}


def expected_pair(policy: Policy, pool_name: str) -> ExpectedPair | None:
    """What a pool's workers must report. The target's model NAME is not compared with the worker's
    model_path (a filesystem path or hub id); its revision and weight version are. A layer-truncated
    draft has no separate weights, so only its algorithm is checked. Declared draft params that workers
    report (n-gram window, suffix tree bounds: ``DRAFT_PARAM_ARGS``) are compared; the rest (EAGLE's, and
    ngram's num_draft_tokens, which the pool's draft_tokens already pins) are part of the version only."""
    pool = policy.pools[pool_name]
    pair = policy.pairs.get(pool.pair) if pool.pair else None
    if pair is None:
        return None
    draft = pair.draft
    fixed_k = pool.draft_tokens if isinstance(pool.draft_tokens, int) else None
    model_draft = draft.kind in ("model", "eagle", "eagle3")
    return ExpectedPair(
        target_revision=pair.target.revision, target_weight_version=pair.target.weight_version,
        draft_model_path=draft.model if model_draft else None,
        draft_revision=draft.revision if model_draft else None,
        algorithm=_ALGORITHM[pool.proposer],
        draft_tokens=fixed_k if pool.speculation == "server" else None,
        draft_params=tuple(sorted((k, v) for k, v in draft.params.items()
                                  if k in DRAFT_PARAMS.get(draft.kind, {}) and k in DRAFT_PARAM_ARGS)))


def topology(policy: Policy) -> tuple:
    return tuple(sorted((name, tuple(pool.workers), expected_pair(policy, name))
                        for name, pool in policy.pools.items()))


def pool_state(snap: PoolSnapshot) -> PoolState:
    healthy = len(snap.healthy_workers)
    return PoolState(healthy=healthy > 0, pair_verified=snap.pair_verified, running=snap.running,
                     waiting=snap.waiting, kv_usage=snap.kv_usage or 0.0, workers_healthy=healthy)


class Backend:
    def __init__(self, policy: Policy, *, monitor_interval_s: float, read_timeout_s: float,
                 identity_interval_s: float = 30.0) -> None:
        self.topology = topology(policy)
        self.pools = {name: WorkerPool(name, pool.workers, expected=expected_pair(policy, name))
                      for name, pool in policy.pools.items()}
        timeouts = ClientTimeouts(read=read_timeout_s)
        self.monitor = PoolMonitor(
            list(self.pools.values()), interval_s=monitor_interval_s, timeouts=timeouts,
            identity_interval_s=identity_interval_s,
            client_factory=lambda url: SGLangClient(url, timeouts=timeouts, transport=ShardedTransport(),
                                            fast_json=True))
        self.models: dict[str, str] = {}  # url -> served model name
        self.context: dict[str, int] = {}  # url -> context_length
        self.info: dict[str, ServerInfo] = {}  # url -> its last /server_info (the trace recorder's header)
        self.in_flight = 0
        self._catalog_task: asyncio.Task[None] | None = None

    def client(self, url: str) -> SGLangClient:
        return self.monitor.client(url)

    def take(self, pool: str, url: str) -> None:
        """A request starts on ``url`` of ``pool``: the worker's in-flight count (which ``pick`` balances) and
        the gateway's (which ``stop_when_idle`` waits on) rise together. The one place either changes."""
        self.pools[pool].acquire(url)
        self.in_flight += 1

    def give_back(self, pool: str, url: str, served_at: float | None = None) -> None:
        """That request left ``url``, whatever its outcome; ``served_at``: it was answered then, which clears
        the worker's failure streak."""
        worker_pool = self.pools[pool]
        worker_pool.release(url)
        if served_at is not None:
            worker_pool.report_success(url, served_at)
        self.in_flight = max(0, self.in_flight - 1)

    async def start(self) -> None:
        await self.monitor.start()
        await self.refresh_catalog()
        self._catalog_task = asyncio.create_task(self._catalog_loop(), name="specgate-catalog")

    async def stop(self) -> None:
        if self._catalog_task is not None:
            self._catalog_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._catalog_task
        await self.monitor.stop()

    async def stop_when_idle(self, limit_s: float = 600.0) -> None:
        deadline = time.monotonic() + limit_s
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await self.stop()

    async def _catalog_loop(self) -> None:
        while True:
            await asyncio.sleep(self.monitor.interval_s * 5 if self.models else self.monitor.interval_s)
            await self.refresh_catalog()

    async def refresh_catalog(self) -> None:
        async def one(url: str) -> None:
            try:
                info = await self.client(url).server_info()
            except WorkerError as exc:
                log.debug("server_info_failed", url=url, error=str(exc))
                return
            self.info[url] = info
            if info.served_model_name:
                self.models[url] = info.served_model_name
            if info.context_length:
                self.context[url] = info.context_length
        await asyncio.gather(*(one(url) for url in self.monitor.clients))

    def step_cost_reports(self, now: float) -> list[tuple[str, ServerInfo]]:
        """(url, last ``/server_info``) of each healthy worker that reports a step-cost table (specgate's
        worker), in the policy's order of pools and workers: what prices ``POST /admin/replay`` when the policy
        names no cost model file."""
        return [(w.url, self.info[w.url]) for pool in self.pools.values() for w in pool.workers.values()
                if w.healthy and not w.ejected(now) and w.url in self.info and self.info[w.url].specgate_step_costs]

    def chat_stream_ids(self, pool: str) -> bool:
        """Whether every worker of ``pool`` sends token ids in chat stream chunks (specgate's worker does; SGLang
        sends a chat answer's ids only at its end): what a whole chat answer needs to resume (gateway/resume.py)."""
        workers = self.pools[pool].workers if pool in self.pools else {}
        return bool(workers) and all(url in self.info and self.info[url].specgate_tokenizer_digest is not None
                                     for url in workers)

    def model_names(self) -> list[str]:
        return sorted(set(self.models.values()))

    def context_length(self) -> int | None:
        """The smallest context window any worker reported (requests may land on any of them)."""
        return min(self.context.values()) if self.context else None

    def pool_keys(self, pair_versions: dict[str, str]) -> dict[str, str | None]:
        """The pair gates' key of every pool with a pair: its declared pair version and a digest of the
        identities its healthy, matching workers report (None while no such worker has reported one): a
        policy edit of the pair, or a worker restarted with other weights or draft settings, is a new key."""
        now = time.monotonic()
        keys: dict[str, str | None] = {}
        for name, version in pair_versions.items():
            pool = self.pools.get(name)
            if pool is None or not version:
                continue
            ids = sorted({msgspec.json.encode(w.identity, order="sorted") for w in pool.selectable(now)
                          if w.identity is not None})
            keys[name] = f"{version}-{hashlib.sha256(b'|'.join(ids)).hexdigest()[:8]}" if ids else None
        return keys

    def pool_snapshots(self, now: float) -> dict[str, PoolSnapshot]:
        return {name: pool.snapshot(now) for name, pool in self.pools.items()}
