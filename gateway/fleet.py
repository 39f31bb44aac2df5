"""Fleet state: the gateways of one fleet share what they learn and enforce through one Valkey (or any Redis-protocol
server), set by the policy's ``state:`` section or ``specgate serve --state URL`` (docs/deploy.md#a-fleet-of-gateways).

What is shared, and how (every key under ``{key_prefix}:``; values are labels and numbers only, never prompt or
output text, API keys or the admin token):

- the learner's sums: each replica publishes its *own* decayed sums (``sums:{replica}``, one hash field per
  table and key, only the keys that changed since its last flush) and reads the other replicas' (only those whose
  ``sumsver:{replica}`` moved); its snapshots decide from ``own + others`` (:mod:`policies.shared_sums`: exact, and
  nothing counted twice however often a replica republishes). Staleness: a replica's evidence reaches the others
  within two sync intervals (its flush, then their read).
- exploration in flight: each replica's counts (``explore:{replica}``, expiring with its heartbeat); decisions
  see their fleet-wide sum.
- outcomes: every finished request's gate sample (``served:{request id}``, the outcome TTL); ``POST /v1/outcomes``
  on any replica claims the report atomically (a script: unknown / already reported / taken) and appends it to the
  ``reports`` stream, which every replica's outcome gate reads.
- route limits: a token bucket per route and kind in the store (a script with the server's clock: GCRA-like
  refill, atomic); each replica admits from a small reserve it was granted from that bucket, refilled off the
  request path, so the fleet admits at most what the bucket grants (R x t + burst) and no request waits for Valkey.
- pair gates: one replica at a time runs a pair version's canaries (``gate:{pool}:{key}:lease``: expiry and a
  fencing token; only the current holder can write the verdict); the others, and a replica that (re)starts, read
  the verdict instead of running it.
- the serving ramp and collapse windows: every replica's finished requests' gate samples go to the ``samples``
  stream (capped), which every replica's pair gates read as their own evidence.
- heartbeats (``hb:{replica}``): version, policy digest, last sync; ``/admin/fleet`` shows them.

Faults: every call to the server is bounded by ``state.timeout_ms`` (a sync round by three of them) and runs off the
request path (the outcome endpoint and a due gate run wait for it, bounded the same way). When the server is
unreachable a replica logs it once, sets ``specgate_state_up`` to 0 and runs on its local state: its own sums,
local exploration counts, local outcomes, its local buckets (each replica then admits up to R on its own) and local
gate runs. When the server returns, it republishes its own sums whole (idempotent: they replace, never add), so
nothing is counted twice; an empty restarted server is detected the same way (its hash shorter than published).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog
from prometheus_client import CollectorRegistry, Gauge, Histogram

from gateway.fleet_gates import FleetGates
from gateway.fleet_limits import FleetLimits
from gateway.gates.values import Sample
from policies.schema import State
from policies.shared_sums import TABLES, Merger, Summary, field_of, from_wire, sum_counts, to_wire

log = structlog.get_logger("specgate.fleet")

SUMS_TTL_S = 7 * 24 * 3600  # a replica's published sums outlive it (the others keep its evidence), decayed anyway
REPORTS_MAXLEN = 100_000
SAMPLES_MAXLEN = 100_000  # the gate samples stream (~300 bytes each): the last ~100k finished requests

# an outcome report: the served sample must exist for this route, and be reported once fleet-wide
_CLAIM = """
local s = redis.call('GET', KEYS[1])
if not s then return {'unknown'} end
local sep = string.find(s, '\\31', 1, true)
if not sep or string.sub(s, 1, sep - 1) ~= ARGV[1] then return {'unknown'} end
if not redis.call('SET', KEYS[2], ARGV[3], 'NX', 'PX', ARGV[2]) then return {'reported'} end
local sample = string.sub(s, sep + 1)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'sample', sample, 'score', ARGV[4], 'by', ARGV[3])
return {'taken', sample}
"""

def connect_url(url: str) -> str:
    """``valkey://`` is ``redis://`` on the wire, ``valkeys://`` is ``rediss://`` (TLS)."""
    scheme, rest = url.split("://", 1)
    return {"valkey": "redis", "valkeys": "rediss"}.get(scheme, scheme) + "://" + rest


def password_of(config: State, base_dir: Path) -> str | None:
    """The server's password from ``password_env`` or ``password_file``; ValueError when named but missing."""
    if config.password_env:
        value = os.environ.get(config.password_env)
        if not value:
            raise ValueError(f"state.password_env names ${config.password_env}, which is not set")
        return value
    if config.password_file:
        path = Path(config.password_file)
        path = path if path.is_absolute() else base_dir / path
        try:
            return path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"state.password_file {path}: {exc.strerror}") from None
    return None


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge("specgate_state_up", "1 while the fleet state store answers, 0 while this replica runs on "
                        "its local state.", registry=registry)
        self.sync = Histogram("specgate_state_sync_seconds", "Duration of one sync round with the state store.",
                              buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0), registry=registry)
        self.lag = Gauge("specgate_state_flush_lag_seconds", "Seconds since this replica's evidence last reached the "
                         "store (grows while the store is unreachable).", registry=registry)
        self.replicas = Gauge("specgate_state_replicas", "Replicas of the fleet with a live heartbeat.",
                              registry=registry)
        self.failures = Gauge("specgate_state_failures", "Sync rounds that failed since start.", registry=registry)


@dataclass
class Fleet:
    """One replica's connection to the fleet state; every method that talks to the server is async and bounded."""

    config: State
    base_dir: Path
    registry: CollectorRegistry | None = None
    replica: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}")

    def __post_init__(self) -> None:
        import redis.asyncio as aioredis  # 0.3 s to import: only a gateway with ``state`` configured pays it

        self.prefix = self.config.key_prefix
        self.timeout = self.config.timeout_ms / 1000.0
        self.interval = self.config.sync_interval_s
        self.client = aioredis.Redis.from_url(
            connect_url(self.config.url), password=password_of(self.config, self.base_dir),
            socket_timeout=self.timeout, socket_connect_timeout=self.timeout, retry_on_timeout=False,
            health_check_interval=0, single_connection_client=False)
        self._claim = self.client.register_script(_CLAIM)
        self.metrics = FleetMetrics(self.registry if self.registry is not None else CollectorRegistry())
        self.up = False
        self.ever_up = False
        self.last_sync: float | None = None  # time.time() of the last round that reached the store
        self.last_error: str | None = None
        self.failures = 0
        self.sync_s: float | None = None
        self._warned = False
        self.offset = time.time() - time.monotonic()
        self.info: dict[str, Any] = {}
        self.replicas: dict[str, dict[str, Any]] = {}
        # learner
        self.merger = Merger()
        self.merger_sources: set[str] = set()
        self._published: dict[tuple[str, str], object] = {}
        self._published_n = 0
        self._their_version: dict[str, int] = {}
        self._version = 0  # this replica's sums version (bumped by every flush that changed something)
        self._their_sums: dict[str, dict[str, dict[str, Summary]]] = {}
        self.remote_exploring: dict[str, int] = {}
        # outcomes
        self._served: deque[tuple[Sample, float]] = deque(maxlen=100_000)
        self._cursor = "0-0"
        # pair gates' live evidence (ramp windows, collapse windows): every replica's finished requests' samples
        self._observed: deque[Sample] = deque(maxlen=100_000)
        self._samples_cursor = f"{int(time.time() * 1000)}-0"  # from now on: a starting replica ramps afresh
        self.remote_samples: list[Sample] = []
        self.limits = FleetLimits(self)  # route limits (gateway/fleet_limits.py)
        self.gates = FleetGates(self)  # pair gate runs' leases and verdicts (gateway/fleet_gates.py)
        self._sync_lock = asyncio.Lock()

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    # -- health --------------------------------------------------------------------------------------

    def _ok(self) -> None:
        if not self.up and self.ever_up:
            log.warning("fleet_state_reconnected", url=self.config.url.split("://")[0], replica=self.replica)
        self.up = self.ever_up = True
        self._warned = False
        self.last_error = None
        self.last_sync = time.time()
        self.metrics.up.set(1)

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        self.metrics.failures.set(self.failures)
        self.metrics.up.set(0)
        self.last_error = f"{type(exc).__name__}: {exc}"[:300]
        if self.up or not self._warned:  # logged once per outage
            log.warning("fleet_state_unreachable", error=self.last_error, replica=self.replica,
                        fallback="local state until the store answers again")
            self._warned = True
        self.up = False
        self.remote_exploring = {}  # the others' explorations are unknown now: only this replica's count
        self._published.clear()  # republish whole when it returns (replaces, never adds)
        self.limits.lost()

    async def bounded(self, coro: Any, calls: int = 1) -> Any:
        """A call to the server, bounded by ``timeout_ms`` per call; marks the store down when it fails."""
        try:
            async with asyncio.timeout(self.timeout * calls):
                return await coro
        except (Exception, TimeoutError) as exc:  # noqa: BLE001 - any failure of the store is a fallback
            self._failed(exc)
            raise FleetDown(str(exc)) from None

    async def close(self) -> None:
        """Give back this replica's concurrency slots (the others may take them at once) and disconnect."""
        with contextlib.suppress(Exception):
            if self.up and self.limits.slot_shares:
                pipe = self.client.pipeline(transaction=False)
                self.limits.give_back_slots(pipe)
                await self.bounded(pipe.execute())
        with contextlib.suppress(Exception):
            await self.client.aclose()

    # -- the sync round ------------------------------------------------------------------------------

    async def sync(self, own: Mapping[str, Mapping[str, Summary]], exploring: Mapping[str, int],
                   half_life_s: float, info: Mapping[str, Any]) -> list[tuple[Sample, float, str]]:
        """One round: heartbeat, flush own sums and exploration counts and served samples, read the others'.
        Returns the outcome reports other replicas took since the last round: (sample, score, by). One round at a
        time (the loop, and the outcome endpoint flushing a request it served)."""
        async with self._sync_lock:
            return await self._sync(own, exploring, half_life_s, info)

    async def _sync(self, own: Mapping[str, Mapping[str, Summary]], exploring: Mapping[str, int],
                    half_life_s: float, info: Mapping[str, Any]) -> list[tuple[Sample, float, str]]:
        started = time.perf_counter()
        self.offset = time.time() - time.monotonic()
        hb_ttl = max(3, int(self.interval * 10))
        changed: dict[str, bytes] = {}
        published = dict(self._published)
        for table in TABLES:
            for key, summary in own.get(table, {}).items():
                if published.get((table, key)) is not summary:
                    changed[field_of(table, key)] = to_wire(summary, self.offset)
                    published[(table, key)] = summary
        served = list(self._served)
        me = self.replica
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.key("hb", me), msgspec.json.encode({**info, "replica": me, "at": time.time()}), ex=hb_ttl)
        pipe.sadd(self.key("replicas"), me)
        if changed:
            pipe.hset(self.key("sums", me), mapping=changed)
            # the version is this process's own counter, never the store's: after a store restart a republish is a
            # new version to every reader (a counter restarted by the store could repeat one a reader cached)
            self._version += 1
            pipe.set(self.key("sumsver", me), self._version)
        pipe.sadd(self.key("sums_replicas"), me)
        pipe.expire(self.key("sums", me), SUMS_TTL_S)
        pipe.expire(self.key("sumsver", me), SUMS_TTL_S)
        pipe.hlen(self.key("sums", me))
        pipe.delete(self.key("explore", me))
        if exploring:
            pipe.hset(self.key("explore", me), mapping={k: v for k, v in exploring.items()})
            pipe.expire(self.key("explore", me), hb_ttl)
        for sample, ttl_s in served:
            pipe.set(self.key("served", sample.request_id), sample.route.encode() + b"\x1f" +
                     msgspec.json.encode(sample), px=max(1, int(ttl_s * 1000)))
        observed = list(self._observed)
        for sample in observed:
            pipe.xadd(self.key("samples"), {"sample": msgspec.json.encode(sample), "by": me},
                      maxlen=SAMPLES_MAXLEN, approximate=True)
        pipe.smembers(self.key("replicas"))
        pipe.smembers(self.key("sums_replicas"))
        pipe.xread({self.key("reports"): self._cursor}, count=10_000)
        pipe.xread({self.key("samples"): self._samples_cursor}, count=10_000)
        results = await self.bounded(pipe.execute(), calls=3)
        for _ in served:
            self._served.popleft()
        for _ in observed:
            self._observed.popleft()
        self._published = published
        samples_raw, reports_raw, sums_replicas, replicas = results[-1], results[-2], results[-3], results[-4]
        hlen = results[5 + (2 if changed else 0)]
        if hlen < len(published):  # the store lost our sums (restarted empty): publish everything next round
            self._published.clear()
        others = sorted(r.decode() for r in replicas if r.decode() != me)
        sum_others = sorted(r.decode() for r in sums_replicas if r.decode() != me)
        pipe = self.client.pipeline(transaction=False)
        for r in others:
            pipe.get(self.key("hb", r))
            pipe.hgetall(self.key("explore", r))
        for r in sum_others:
            pipe.get(self.key("sumsver", r))
        got = await self.bounded(pipe.execute(), calls=2)
        live: dict[str, dict[str, Any]] = {me: {**info, "replica": me, "at": time.time()}}
        explores: list[dict[str, int]] = []
        dead = []
        for i, r in enumerate(others):
            hb, explore = got[2 * i], got[2 * i + 1]
            if hb is None:
                dead.append(r)
                continue
            live[r] = msgspec.json.decode(hb)
            explores.append({k.decode(): int(v) for k, v in explore.items()})
        versions = {r: int(v or 0) for r, v in zip(sum_others, got[2 * len(others):], strict=True)}
        stale = [r for r in sum_others if versions[r] != self._their_version.get(r)]
        if stale:
            pipe = self.client.pipeline(transaction=False)
            for r in stale:
                pipe.hgetall(self.key("sums", r))
            for r, fields in zip(stale, await self.bounded(pipe.execute(), calls=2), strict=True):
                tables: dict[str, dict[str, Summary]] = {t: {} for t in TABLES}
                for name, raw in fields.items():
                    parsed = from_wire(name, raw, self.offset)
                    if parsed is not None:
                        tables[parsed[0]][parsed[1]] = parsed[2]
                self._their_sums[r] = tables
                self._their_version[r] = versions[r]
        for r in [r for r in self._their_sums if r not in versions]:
            del self._their_sums[r]
        if stale or set(self._their_sums) != self.merger_sources:
            self.merger.set_others(self._their_sums.values(), half_life_s)
            self.merger_sources = set(self._their_sums)
        if dead:
            with contextlib.suppress(Exception):
                await self.bounded(self.client.srem(self.key("replicas"), *dead))
        self.remote_exploring = sum_counts(*explores)
        self.replicas = live
        out: list[tuple[Sample, float, str]] = []
        for _stream, entries in reports_raw or []:
            for entry_id, fields in entries:
                self._cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                by = fields.get(b"by", b"").decode()
                if by == me:
                    continue
                with contextlib.suppress(msgspec.DecodeError, ValueError):
                    out.append((msgspec.json.decode(fields[b"sample"], type=Sample), float(fields[b"score"]), by))
        for _stream, entries in samples_raw or []:
            for entry_id, fields in entries:
                self._samples_cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                if fields.get(b"by", b"").decode() != me:
                    with contextlib.suppress(msgspec.DecodeError):
                        self.remote_samples.append(msgspec.json.decode(fields[b"sample"], type=Sample))
        self._ok()
        self.sync_s = time.perf_counter() - started
        self.metrics.sync.observe(self.sync_s)
        self.metrics.lag.set(0.0)
        self.metrics.replicas.set(len(live))
        return out

    def lag_s(self) -> float | None:
        return None if self.last_sync is None else time.time() - self.last_sync

    # -- outcomes ------------------------------------------------------------------------------------

    def served(self, sample: Sample, ttl_s: float) -> None:
        """A finished request's gate sample, flushed with the next round (the request path only appends)."""
        self._served.append((sample, ttl_s))

    def observed(self, sample: Sample) -> None:
        """A finished request's gate sample for the other replicas' serving ramp and collapse windows."""
        self._observed.append(sample)

    def take_samples(self) -> list[Sample]:
        """The other replicas' gate samples read since the last call."""
        samples, self.remote_samples = self.remote_samples, []
        return samples

    async def claim(self, request_id: str, route: str, score: float, ttl_s: float) -> tuple[str, Sample | None]:
        """An outcome report, fleet-wide exactly once: ('taken', sample), ('unknown', None), ('reported', None)."""
        keys = [self.key("served", request_id), self.key("reported", request_id), self.key("reports")]
        answer = await self.bounded(self._claim(keys=keys, args=[route, int(ttl_s * 1000), self.replica,
                                                                 repr(score), REPORTS_MAXLEN]))
        what = answer[0].decode()
        if what != "taken":
            return what, None
        return what, msgspec.json.decode(answer[1], type=Sample)

    async def limits_loop(self) -> None:
        """Refill the route limits' reserves as soon as one runs short (woken by the request path), else every
        50 ms (``FleetLimits.refill``)."""
        while True:
            await self.limits.woken(0.05)
            if not self.up:
                continue
            with contextlib.suppress(FleetDown):
                await self.limits.refill()

    def view(self) -> dict[str, Any]:
        """``/admin/fleet``."""
        return {"backend": self.config.url.split("://")[0] + "://" + self.config.url.split("://", 1)[1].split("/")[0],
                "key_prefix": self.prefix, "replica": self.replica, "up": self.up, "last_sync": self.last_sync,
                "lag_s": self.lag_s(), "sync_ms": None if self.sync_s is None else round(self.sync_s * 1000, 2),
                "failures": self.failures, "last_error": self.last_error, "sync_interval_s": self.interval,
                "replicas": self.replicas,
                "slots": self.limits.view()}


class FleetDown(Exception):
    """The state store did not answer within its bound: the caller runs on its local state."""
