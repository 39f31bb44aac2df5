"""What drives the pair gates in a running gateway: feeding them finished requests, running the equivalence
canaries when a pair version is due, and publishing their changes (logs, metrics, the next decision).

``GateBook`` (book.py) holds the gates' state and decides; this module is its event-loop side. In a fleet
(gateway/fleet.py) one replica at a time runs a pair version's canaries, under a ``GATE_LEASE_S`` lease renewed
while it runs and fenced by its token; the others, and a replica that restarts, adopt the verdict it publishes
(docs/deploy.md, "A fleet of gateways").
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from gateway.fleet import FleetDown
from gateway.gates.book import GateBook
from gateway.gates.canary import CanaryError
from gateway.gates.runner import canaries_of, check_pool
from gateway.gates.values import Sample, Verdict
from gateway.telemetry_views import gate_event_view, gate_views
from policies.compiled import served_pools
from policies.schema import Policy
from policies.snapshot import PoolState

if TYPE_CHECKING:
    from gateway.active import Active
    from gateway.backend import Backend
    from gateway.fleet import Fleet
    from telemetry import Telemetry
    from telemetry.record import RequestRecord

log = structlog.get_logger("specgate.gateway")

GATE_TICK_S = 0.5  # how often the pair gates sync with the workers' identities and start due runs
GATE_LEASE_S = 10.0  # a fleet gate run's lease: renewed every third of it while running; a dead holder's expires
UNSERVED = ("no rule serves this pool: its equivalence gate runs when one does (a policy reload), or on "
            "POST /admin/pools/{pool}/check")


def canary_problems(policy: Policy, base_dir: Path) -> list[str]:
    """Why the policy's canary file cannot be used (a start or reload with one is refused); empty when it can."""
    try:
        canaries_of(policy, base_dir)
    except CanaryError as exc:
        return [str(exc)]
    return []


class GateDriver:
    """The pair gates of one gateway. ``active``/``backend``: the current policy version and backend (both are
    replaced on reload); ``spawn``: the gateway's fire-and-forget tasks; ``changed``: a verdict or hold must
    reach the next request's decision (the snapshot is rebuilt)."""

    def __init__(self, policy: Policy, base_dir: Path, telemetry: Telemetry, fleet: Fleet | None,
                 active: Callable[[], Active], backend: Callable[[], Backend], spawn: Callable[[Any], None],
                 changed: Callable[[], None]) -> None:
        self.book = GateBook(policy.gates)
        self.base_dir = base_dir
        self.canaries = canaries_of(policy, base_dir)  # CanaryError: a startup failure
        self._telemetry, self._fleet = telemetry, fleet
        self._active, self._backend, self._spawn, self._changed = active, backend, spawn, changed
        self._run_lock = asyncio.Lock()  # one run at a time: canaries load the same workers users are on
        self._shown = False
        self._asked: set[str] = set()  # pools an operator asked to check, served by a rule or not

    def configure(self, policy: Policy) -> None:
        """A policy reload (its canary file was checked by :func:`canary_problems`)."""
        self.book.configure(policy.gates)
        self.canaries = canaries_of(policy, self.base_dir)

    def pool_state(self, name: str, state: PoolState, now: float) -> PoolState:
        """A pool's state for the decision snapshot, with its gate, ramp and ramp default."""
        gate, ramp, default = self.book.pool_state(name, now)
        if gate is None:
            return state
        return msgspec.structs.replace(state, gate=gate, ramp=ramp, ramp_default=default)

    def observe(self, record: RequestRecord) -> None:
        """A finished request's evidence for the serving, outcome and collapse gates (from the record telemetry
        gets, built once per request)."""
        settings = self.book.settings
        if settings is None:
            return
        gate = self.book.pools.get(record.pool)
        buckets = self._active().policy.learning.concurrency_buckets
        sample = Sample.of(record, bisect.bisect_left(buckets, max(1, record.concurrency)), gate.key if gate else "")
        self.book.observe(sample, time.monotonic(), time.time())
        if self._fleet is not None:  # appended here, flushed off the request path
            if settings.outcome is not None and sample.ok:
                self._fleet.served(sample, settings.outcome.ttl_s)  # any replica takes its outcome
            if settings.serving is not None or settings.collapse is not None:
                self._fleet.observed(sample)  # every replica's ramp and collapse windows see it

    def from_fleet(self, samples: list[Sample], reports: list[tuple[Sample, float, Any]]) -> None:
        """A fleet sync round's news: the other replicas' finished requests (evidence for the ramp and collapse
        windows) and outcomes reported to them."""
        wall, now = time.time(), time.monotonic()
        for sample in samples:
            self.book.observe(sample, now, wall)
        for sample, score, _by in reports:
            self.book.report_sample(sample, score, wall)
        if reports or samples:
            self.publish(time.monotonic())

    def tick(self) -> None:
        """Sync the gates with the pools' current pair keys, start the equivalence runs that are due, and
        publish what changed."""
        active = self._active()
        policy = active.policy
        now = time.monotonic()
        if policy.gates is not None:
            paired = {name: version for name, version in active.pair_versions.items()
                      if version and policy.pools[name].proposer != "none"}
            self.book.sync(self._backend().pool_keys(paired), now, time.time())
            for pool in self.due(now):  # runs take turns in this order (one at a time, FIFO)
                self._asked.discard(pool)
                self._spawn(self._run(pool, self.book.started(pool)))
        self.publish(now)

    def due(self, now: float) -> list[str]:
        """The pools whose equivalence run is due and that a rule serves, in :func:`policies.compiled.served_pools`' order, then
        those an operator asked for; a due pool no rule serves is told why it waits."""
        due = self.book.due(now)
        out = [pool for pool in served_pools(self._active().policy) if pool in due]
        for pool in due:
            if pool in out:
                continue
            if pool in self._asked:
                out.append(pool)
            else:
                self.book.note(pool, UNSERVED.format(pool=pool))
        return out

    def recheck(self, pool: str, now: float, wall: float) -> bool:
        """An operator's re-check (``POST /admin/pools/NAME/check``), which runs whether a rule serves the pool
        or not; False while a run is in progress."""
        if not self.book.force_recheck(pool, now, wall):
            return False
        self._asked.add(pool)
        self.tick()
        return True

    def publish(self, now: float) -> None:
        """Log and count the gates' state changes; a change reaches the next request's decision."""
        events = self.book.drain()
        if events:
            self._telemetry.record_gate_events([gate_event_view(e) for e in events])
            self._changed()
        views = gate_views(self.book, now)
        if views or self._shown:  # without gates, nothing to export (once more after they go: the clear)
            self._telemetry.set_gates(views)
        self._shown = bool(views)

    async def loop(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the gates must outlive one bad round
                log.exception("pair_gate_tick_failed")
            await asyncio.sleep(GATE_TICK_S)

    async def _fleet_gate(self, pool: str, key: str) -> tuple[bool, str | None]:
        """In a fleet: (done, lease holder). Done when the fleet's verdict for this key was adopted, or another
        replica holds the run's lease (this one waits for its verdict); else this replica runs the canaries
        under the lease it returns (None: the store is unreachable, the run is local)."""
        fleet = self._fleet
        gate = self.book.pools.get(pool)
        if fleet is None or not fleet.up or gate is None:
            return False, None
        try:
            shared = await fleet.gates.verdict(pool, key) if gate.verdict is None else None
            if shared is not None:  # a replica that starts or restarts reads the verdict instead of re-running
                self.book.finished(pool, key, shared, time.monotonic(), time.time())
                self.tick()
                return True, None
            holder = await fleet.gates.acquire(pool, key, GATE_LEASE_S)
        except FleetDown:
            return False, None
        if holder is None:
            self.book.postpone(pool, key, time.monotonic() + fleet.interval,
                               "another replica of the fleet runs the equivalence gate; waiting for its verdict")
            return True, None
        return False, holder

    async def _renew_lease(self, pool: str, key: str, holder: str) -> None:
        assert self._fleet is not None
        while True:
            await asyncio.sleep(GATE_LEASE_S / 3)
            with contextlib.suppress(FleetDown):
                await self._fleet.gates.renew(pool, key, holder, GATE_LEASE_S)

    async def _run(self, pool: str, key: str) -> None:
        """One equivalence run of ``pool`` at pair key ``key`` (or the fleet's verdict for it)."""
        done, holder = await self._fleet_gate(pool, key)
        if done:
            return
        renewer = asyncio.get_running_loop().create_task(self._renew_lease(pool, key, holder)) if holder else None
        try:
            async with self._run_lock:
                policy = self._active().policy
                assert policy.gates is not None
                verdict = await check_pool(policy, pool, self._backend(), self.canaries, policy.gates.equivalence)
        except Exception as exc:  # noqa: BLE001 - a run that breaks is an error verdict, never a stuck gate
            log.exception("pair_gate_run_failed", pool=pool)
            verdict = Verdict(passed=False, error=True, reason=f"the gate run raised {type(exc).__name__}: {exc}")
        finally:
            if renewer is not None:
                renewer.cancel()
        if holder is not None and self._fleet is not None and not verdict.error:
            try:
                if not await self._fleet.gates.publish_verdict(pool, key, holder, verdict):
                    # fenced: this replica's lease expired and another took the run; its verdict is the fleet's
                    log.warning("pair_gate_lease_lost", pool=pool, key=key)
                    verdict = await self._fleet.gates.verdict(pool, key) or verdict
            except FleetDown:
                pass
        self.book.finished(pool, key, verdict, time.monotonic(), time.time())
        self.tick()
