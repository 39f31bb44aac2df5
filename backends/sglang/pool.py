"""Worker pools: pure bookkeeping over worker URLs (no I/O, time passed in by the caller).

A pool is a named set of workers that share one speculative configuration (SGLang fixes speculation
per server, so a pool IS a configuration). The gateway asks ``pick`` for a worker and reports every
outcome; ``backends.sglang.monitor`` feeds health, load and identity from the workers. Keeping this
free of I/O lets tests drive every transition with scripted times (CONTRIBUTING.md #1).

Rules, each with its why:
- Selection: least loaded by ``in_flight + running + waiting`` (in_flight is counted by the gateway
  and is current; running/waiting come from the last ``/v1/loads`` poll and may be a few seconds
  old), ties broken round robin so equal workers share load.
- Only healthy, non-ejected workers whose pair identity does not contradict the declared one are
  picked. A worker starts unhealthy until its first successful health check.
- Ejection: ``eject_after`` consecutive failures (health checks and passive failures reported by the
  gateway alike) eject a worker for ``backoff_s * 2**(ejections-1)`` seconds (capped at
  ``max_backoff_s``). After that the monitor probes it again; one successful health check returns
  it (and resets the failure count, not the ejection count, which decays on a success).
- ``kv_usage`` of the pool is the MAX ``token_usage`` over healthy workers by default: the policy's
  "bypass under KV pressure" rule should trip when any worker the pool may route to is nearly full;
  ``kv_usage_mode="mean"`` reports pool-wide capacity instead.
- ``pair_verified``: None when nothing is declared or some healthy worker's identity is unknown,
  False when any healthy worker contradicts the declaration, True when all healthy workers match.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from backends.sglang.pair import ExpectedPair, PairIdentity, pair_mismatches
from backends.sglang.wire import LoadsResponse


class PoolSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    eject_after: int = 3
    backoff_s: float = 5.0
    max_backoff_s: float = 60.0
    kv_usage_mode: Literal["max", "mean"] = "max"

    def __post_init__(self) -> None:
        if self.eject_after < 1:
            raise ValueError(f"eject_after must be >= 1, got {self.eject_after}")
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {self.backoff_s}, "
                             f"{self.max_backoff_s}")


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One ``/v1/loads`` poll summed over data-parallel ranks (token_usage: the fullest rank)."""

    running: int
    waiting: int
    token_usage: float
    max_running_requests: int | None
    accept_length: float | None
    at: float

    @classmethod
    def from_loads(cls, loads: LoadsResponse, now: float) -> WorkerLoad:
        ranks = loads.loads
        caps = [r.max_running_requests for r in ranks if r.max_running_requests is not None]
        accepts = [r.speculative.accept_length for r in ranks
                   if r.speculative is not None and r.speculative.accept_length is not None]
        return cls(
            running=sum(r.num_running_reqs for r in ranks),
            waiting=sum(r.num_waiting_reqs for r in ranks),
            token_usage=max((r.token_usage for r in ranks), default=0.0),
            max_running_requests=sum(caps) if caps else None,
            accept_length=sum(accepts) / len(accepts) if accepts else None,
            at=now,
        )


@dataclass(slots=True)
class WorkerState:
    """Everything the pool knows about one worker."""

    url: str
    healthy: bool = False
    consecutive_failures: int = 0
    ejections: int = 0
    ejected_until: float | None = None
    last_error: str | None = None
    load: WorkerLoad | None = None
    identity: PairIdentity | None = None
    identity_at: float | None = None
    mismatches: list[str] = field(default_factory=list)
    in_flight: int = 0

    def ejected(self, now: float) -> bool:
        return self.ejected_until is not None and now < self.ejected_until

    @property
    def score(self) -> int:
        load = self.load
        return self.in_flight + (load.running + load.waiting if load else 0)


class PoolSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Immutable view for the policy: the policy reads a snapshot, never the pool (docs/architecture.md,
    "Parts and layers")."""

    name: str
    workers: int
    healthy_workers: tuple[str, ...]
    running: int
    waiting: int
    in_flight: int
    kv_usage: float | None
    accept_length: float | None
    pair_verified: bool | None


class WorkerPool:
    """A named set of workers with one speculative configuration. Not thread-safe (one event loop)."""

    def __init__(self, name: str, urls: Sequence[str], *, expected: ExpectedPair | None = None,
                 settings: PoolSettings = PoolSettings()) -> None:
        if not urls:
            raise ValueError(f"pool {name!r} needs at least one worker URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"pool {name!r} lists a worker URL twice: {list(urls)}")
        self.name = name
        self.expected = expected
        self.settings = settings
        self.workers: dict[str, WorkerState] = {url: WorkerState(url) for url in urls}
        self._rr = 0

    def _get(self, url: str) -> WorkerState:
        try:
            return self.workers[url]
        except KeyError:
            raise KeyError(f"{url} is not a worker of pool {self.name!r}") from None

    # -- selection ---------------------------------------------------------------------------------

    def selectable(self, now: float) -> list[WorkerState]:
        return [w for w in self.workers.values()
                if w.healthy and not w.ejected(now) and not w.mismatches]

    def pick(self, now: float, exclude: Collection[str] = ()) -> WorkerState | None:
        """Least-loaded selectable worker not in ``exclude`` (round robin among ties), or None."""
        candidates = [w for w in self.selectable(now) if w.url not in exclude]
        if not candidates:
            return None
        best = min(w.score for w in candidates)
        tied = [w for w in candidates if w.score == best]
        chosen = tied[self._rr % len(tied)]
        self._rr += 1
        return chosen

    def acquire(self, url: str) -> None:
        """The gateway sent a request to ``url``."""
        self._get(url).in_flight += 1

    def release(self, url: str) -> None:
        """That request finished (any outcome)."""
        worker = self._get(url)
        worker.in_flight = max(0, worker.in_flight - 1)

    # -- outcomes ----------------------------------------------------------------------------------

    def report_success(self, url: str, now: float) -> None:
        """A request or health check succeeded: clears the failure streak; returns an ejected
        worker once its backoff has passed."""
        worker = self._get(url)
        if worker.ejected(now):
            return  # a late answer from before the ejection does not cut the backoff short
        worker.healthy = True
        worker.consecutive_failures = 0
        worker.ejected_until = None
        worker.ejections = max(0, worker.ejections - 1)
        worker.last_error = None

    def report_failure(self, url: str, now: float, reason: str) -> None:
        """A request (passive) or health check failed; ejects after ``eject_after`` in a row."""
        worker = self._get(url)
        worker.consecutive_failures += 1
        worker.last_error = reason
        if worker.ejected(now):
            return
        if worker.ejected_until is not None or worker.consecutive_failures >= self.settings.eject_after:
            # a failed probe after a backoff re-ejects at once, with a longer backoff
            worker.ejections += 1
            backoff = self.settings.backoff_s * 2 ** (worker.ejections - 1)
            worker.ejected_until = now + min(backoff, self.settings.max_backoff_s)
            worker.healthy = False

    def needs_probe(self, url: str, now: float) -> bool:
        """Whether the monitor should health-check ``url`` now (not while its backoff runs)."""
        return not self._get(url).ejected(now)

    def record_load(self, url: str, loads: LoadsResponse, now: float) -> None:
        self._get(url).load = WorkerLoad.from_loads(loads, now)

    def record_identity(self, url: str, identity: PairIdentity, now: float) -> None:
        worker = self._get(url)
        worker.identity = identity
        worker.identity_at = now
        worker.mismatches = pair_mismatches(self.expected, identity) if self.expected else []

    # -- snapshot ----------------------------------------------------------------------------------

    def _pair_verified(self, healthy: list[WorkerState]) -> bool | None:
        if self.expected is None or not healthy:
            return None
        if any(w.mismatches for w in healthy):
            return False
        if any(w.identity is None for w in healthy):
            return None
        return True

    def snapshot(self, now: float) -> PoolSnapshot:
        healthy = [w for w in self.workers.values() if w.healthy and not w.ejected(now)]
        loaded = [w.load for w in healthy if w.load is not None]
        usages = [load.token_usage for load in loaded]
        if not usages:
            kv_usage = None
        elif self.settings.kv_usage_mode == "max":
            kv_usage = max(usages)
        else:
            kv_usage = sum(usages) / len(usages)
        accepts = [load.accept_length for load in loaded if load.accept_length is not None]
        return PoolSnapshot(
            name=self.name,
            workers=len(self.workers),
            healthy_workers=tuple(w.url for w in healthy if not w.mismatches),
            running=sum(load.running for load in loaded),
            waiting=sum(load.waiting for load in loaded),
            in_flight=sum(w.in_flight for w in self.workers.values()),
            kv_usage=kv_usage,
            accept_length=sum(accepts) / len(accepts) if accepts else None,
            pair_verified=self._pair_verified(healthy),
        )
