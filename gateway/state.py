"""Everything the gateway holds between requests, in one object created by ``create_app``.

``Active`` is one policy version with what is derived from it (keys, header names, limiters); a reload
builds a new ``Active`` and swaps the reference between requests, so a request keeps the version it
started with. The decision snapshot is rebuilt at most every ``snapshot_max_age_s`` (and only when
something changed), not per request: ``decide`` then costs ~20 us.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import os
import random
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog

from gateway.active import Active
from gateway.auth import KeyRing
from gateway.backend import Backend, pool_state, topology
from gateway.evidence import GatewayEvidence, WorkerCosts
from gateway.fleet import Fleet, FleetDown
from gateway.gates.book import GateBook
from gateway.gates.values import Sample, Verdict
from gateway.gates.canary import CanaryError
from gateway.gates.runner import canaries_of, check_pool
from gateway.limits import RouteLimiter, limiters_for
from gateway.reload import PolicyWatcher, ReloadResult, read_policy
from gateway.settings import GatewaySettings
from gateway.telemetry_views import gate_event_view, gate_views, policy_view, pool_views
from gateway.tracing import Recorder, problems, resolve
from policies.features import reads_prompt_repeat, referenced_headers
from policies.schema import Policy, State
from policies.shared_sums import sum_counts
from policies.snapshot import PoolState, Snapshot, load_concurrency, worker_load
from policies.stats import LearningState, Outcome
from telemetry import Telemetry, otel
from telemetry.record import RequestRecord

log = structlog.get_logger("specgate.gateway")

GATE_TICK_S = 0.5  # how often the pair gates sync with the workers' identities and start due runs
GATE_LEASE_S = 10.0  # a fleet gate run's lease: renewed every third of it while running; a dead holder's expires
STATE_PASSWORD_ENV = "SPECGATE_STATE_PASSWORD"  # `serve --state URL`'s password, unless the policy's state names one


def fleet_config(section: State | None, url: str | None) -> State | None:
    """The fleet state settings: the policy's ``state:`` section, with ``specgate serve --state URL``'s URL over
    its own (or alone, with the defaults)."""
    if url is None:
        return section
    fields = {} if section is None else msgspec.structs.asdict(section)
    if not fields.get("password_env") and not fields.get("password_file") and os.environ.get(STATE_PASSWORD_ENV):
        fields["password_env"] = STATE_PASSWORD_ENV  # the flag's password, when the policy names none
    try:
        return msgspec.convert({**fields, "url": url}, State)
    except msgspec.ValidationError as exc:
        raise ValueError(f"--state {url}: {exc}") from None


class GatewayState:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.path = Path(settings.policy_path)
        policy, version = read_policy(self.path)  # PolicyError: a startup failure, not per request
        view = policy_view(policy)
        self.telemetry = Telemetry(view, debug_text=settings.debug_log_text)
        # fleet state (gateway/fleet.py): the policy's state: section, or `specgate serve --state URL` (its URL
        # over the section's); read at start-up only. None: everything stays in this process, as without it
        config = fleet_config(policy.state, settings.state_url)
        self.fleet = Fleet(config, self.path.parent, registry=self.telemetry.registry) if config else None
        self.active = self._build(policy, version, {})
        self.last_reload = ReloadResult(ok=True, at=time.time(), version=version)
        self.learning = LearningState(policy.learning)
        self.telemetry.set_policy(view, version=version, reload_ok=True, error=None)
        self.backend = self._backend(policy)
        self.gates = GateBook(policy.gates)
        self.canaries = canaries_of(policy, self.path.parent)  # CanaryError: a startup failure
        if errors := self.tracing_problems(policy):
            raise ValueError("\n".join(errors))  # a startup failure, like an invalid policy
        self.recorder = Recorder(resolve(policy.tracing, settings.trace_path, self.path.parent),
                                 worker_info=lambda url: self.backend.info.get(url),
                                 count=self.telemetry.count_trace)
        self.watcher = PolicyWatcher(self.path, version, apply=self.apply_policy, reject=self.reject_policy,
                                     interval_s=settings.reload_interval_s, check=self.tracing_problems)
        # OpenTelemetry trace export (telemetry/otel.py: OTEL_* environment variables); None: off
        self.otel = otel.configure("specgate-gateway")
        if self.otel is not None:
            otel.yield_to_requests()  # the export thread's encoding must not hold requests up for 5 ms at a time
        # full-information evidence for auto (gateway/evidence.py), priced with each worker's live step costs
        self.evidence = GatewayEvidence(WorkerCosts(lambda now: self.backend.step_cost_reports(now)),
                                        observe=lambda *args: self.telemetry.observe_evidence(*args))
        self.rng = random.Random()
        self.in_flight = 0
        self.exploring: dict[str, int] = {}  # exploration_key -> explorations of it in flight (fleet-wide)
        self._own_exploring: dict[str, int] = {}  # ... of this replica alone (what it publishes)
        self._busy_area = 0.0  # integral of the load over time (request-seconds) up to _busy_t
        self._worker_load = 0  # the busiest pool's requests per worker at the pool monitor's latest round
        self._busy_t = time.monotonic()
        self.background: set[asyncio.Task[Any]] = set()
        self._snapshot: Snapshot | None = None
        self._snapshot_at = 0.0
        self._dirty = True
        self._pools_pushed = 0.0
        self.gate_settings_before = policy.gates
        self._gate_run = asyncio.Lock()
        self._gates_shown = False

    def _backend(self, policy: Policy) -> Backend:
        # with gates, every monitor round re-reads the workers' identity: a worker restarted with another pair
        # version must not serve under the old one's verdict until the next identity poll
        backend = Backend(policy, monitor_interval_s=self.settings.monitor_interval_s,
                          read_timeout_s=self.settings.upstream_read_timeout_s,
                          identity_interval_s=self.settings.monitor_interval_s if policy.gates else 30.0)
        backend.monitor.on_round = lambda: self.read_worker_load(backend)
        return backend

    def _build(self, policy: Policy, version: str, old: dict[str, RouteLimiter]) -> Active:
        keys = KeyRing(policy, base_dir=self.path.parent)
        for problem in keys.problems:
            log.warning("policy_keys_problem", problem=problem)
        return Active(policy=policy, version=version, keys=keys,
                      wanted_headers=frozenset(referenced_headers(policy)), reads_repeat=reads_prompt_repeat(policy),
                      limiters=limiters_for(policy.routes, policy.route_names(), old, self.fleet),
                      pair_versions={p: policy.pool_pair_version(p) for p in policy.pools})

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.backend.start()
        self.watcher.start()
        if self.fleet is not None:
            # a replica that starts reads the fleet's evidence first, and knows whether the store answers before
            # a gate run is due (a fleet run takes the lease; a run while the store is down is local)
            with contextlib.suppress(FleetDown):  # unreachable: it starts on its local state, and retries
                await self.sync_fleet()
            self.spawn(self._fleet_loop())
            self.spawn(self.fleet.limits_loop())
        self.gate_tick()  # every gated pool is pending before the first request can be decided
        self.spawn(self._gate_loop())

    async def stop(self) -> None:
        await self.watcher.stop()
        for task in list(self.background):
            task.cancel()
        if self.fleet is not None:
            with contextlib.suppress(FleetDown):
                await self.sync_fleet()  # this replica's last evidence reaches the fleet
            await self.fleet.close()
        await self.backend.stop()
        self.evidence.close()
        self.recorder.close()
        if self.otel is not None:
            await asyncio.to_thread(self.otel.shutdown)  # flushes the spans still queued

    def spawn(self, coro: Any) -> None:
        """Fire-and-forget work (aborts, closing a stream) that must survive a cancelled request."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # -- reload --------------------------------------------------------------------------------------

    def tracing_problems(self, policy: Policy) -> list[str]:
        """What the policy file alone does not show: an unusable trace path or canary file (a reload with
        either is refused, as an invalid policy is)."""
        found = problems(policy, self.settings.trace_path, self.path.parent)
        try:
            canaries_of(policy, self.path.parent)
        except CanaryError as exc:
            found.append(str(exc))
        return found

    def apply_policy(self, policy: Policy, version: str) -> None:
        self.active = self._build(policy, version, self.active.limiters)
        self.recorder.configure(resolve(policy.tracing, self.settings.trace_path, self.path.parent))
        self.learning.configure(policy.learning)
        self.learning.forget_pair_versions(set(self.active.pair_versions.values()))
        self.gates.configure(policy.gates)
        self.canaries = canaries_of(policy, self.path.parent)  # checked by tracing_problems before apply
        if topology(policy) != self.backend.topology or bool(policy.gates) != bool(self.gate_settings_before):
            old, self.backend = self.backend, self._backend(policy)
            self.spawn(self._swap_backend(old, self.backend))
        self.gate_settings_before = policy.gates
        self.last_reload = ReloadResult(ok=True, at=time.time(), version=version)
        self.telemetry.set_policy(policy_view(policy), version=version, reload_ok=True, error=None)
        self._dirty = True

    async def _swap_backend(self, old: Backend, new: Backend) -> None:
        await new.start()
        await old.stop_when_idle()

    def reject_policy(self, result: ReloadResult) -> None:
        self.last_reload = result
        self.telemetry.set_policy(policy_view(self.active.policy), version=self.active.version, reload_ok=False,
                                  error="\n".join(result.errors))

    # -- concurrency ---------------------------------------------------------------------------------

    def busy_area(self, now: float) -> float:
        """Request-seconds served so far: the integral over time of the load decisions are bucketed by
        (:func:`policies.snapshot.load_concurrency`): this gateway's ``in_flight`` or, when more, the busiest
        pool's requests per worker as the pool monitor last read them (other gateways' requests included). The
        difference over a request's life divided by its duration is the mean concurrency it ran at (itself
        included), so the learner files its outcome in the bucket a decision at that load looks up."""
        return self._busy_area + max(self.in_flight, self._worker_load) * (now - self._busy_t)

    def change_in_flight(self, delta: int, now: float) -> None:
        self._busy_area = self.busy_area(now)
        self._busy_t = now
        self.in_flight += delta

    def read_worker_load(self, backend: Backend, now: float | None = None) -> None:
        """After each round of the pool monitor: the busiest pool's requests per worker, from then on in
        ``busy_area`` (a replaced backend's last rounds are ignored)."""
        if backend is self.backend:
            now = time.monotonic() if now is None else now
            self.change_worker_load(worker_load({n: pool_state(s) for n, s in backend.pool_snapshots(now).items()}),
                                    now)

    def change_worker_load(self, load: int, now: float) -> None:
        self._busy_area = self.busy_area(now)
        self._busy_t = now
        self._worker_load = load

    def change_exploring(self, key: str, delta: int) -> None:
        """Count an exploration in flight (+1 when decided, -1 when it finishes, whatever happened); in a fleet
        ``exploring`` also holds the other replicas' counts (as of the last sync)."""
        n = self._own_exploring.get(key, 0) + delta
        if n > 0:
            self._own_exploring[key] = n
        else:
            self._own_exploring.pop(key, None)
        total = max(0, n) + (self.fleet.remote_exploring.get(key, 0) if self.fleet is not None else 0)
        if total > 0:
            self.exploring[key] = total
        else:
            self.exploring.pop(key, None)

    # -- fleet state (gateway/fleet.py) --------------------------------------------------------------

    async def sync_fleet(self) -> None:
        """One sync round with the fleet (FleetDown when the store did not answer: local state goes on)."""
        fleet = self.fleet
        assert fleet is not None
        info = {"policy": self.active.version, "pid": os.getpid(), "in_flight": self.in_flight}
        reports = await fleet.sync(self.learning.tables(), dict(self._own_exploring),
                                   self.active.policy.learning.half_life_s, info)
        wall, now = time.time(), time.monotonic()
        samples = fleet.take_samples()
        for sample in samples:  # the other replicas' finished requests: evidence for the ramp and collapse windows
            self.gates.observe(sample, now, wall)
        for sample, score, _by in reports:
            self.gates.report_sample(sample, score, wall)
        self.exploring = sum_counts(self._own_exploring, fleet.remote_exploring)
        self._dirty = True
        if reports or samples:
            self.publish_gates(time.monotonic())

    async def _fleet_loop(self) -> None:
        assert self.fleet is not None
        while True:
            await asyncio.sleep(self.fleet.interval)
            try:
                await self.sync_fleet()
            except FleetDown:
                self.exploring = dict(self._own_exploring)  # the others' counts are unknown now
                lag = self.fleet.lag_s()
                if lag is not None:
                    self.fleet.metrics.lag.set(lag)
            except Exception:  # noqa: BLE001 - the fleet loop must outlive one bad round
                log.exception("fleet_sync_failed")

    # -- decisions -----------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        now = time.monotonic()
        age = now - self._snapshot_at
        if self._snapshot is None or age >= self.settings.snapshot_max_age_s or \
                (self._dirty and age >= self.settings.snapshot_max_age_s / 2):
            pools = self.backend.pool_snapshots(now)
            states = {name: self._gated(name, pool_state(s), now) for name, s in pools.items()}
            snap = self.learning.snapshot(now, states, load_concurrency(self.in_flight, states))
            if self.fleet is not None:  # decide from every replica's evidence (policies/shared_sums.py)
                snap = self.fleet.merger.snapshot(snap, self.learning.tables())
            self._snapshot = snap
            self._snapshot_at = now
            self._dirty = False
            if now - self._pools_pushed >= 1.0:
                self._pools_pushed = now
                self.telemetry.set_pools(pool_views(pools, {n: list(p.workers.values())
                                                            for n, p in self.backend.pools.items()}))
        return self._snapshot

    def learn(self, outcome: Outcome) -> None:
        self.learning.record(outcome)
        self._dirty = True

    # -- pair gates (gateway/gates/) -----------------------------------------------------------------

    def _gated(self, name: str, state: PoolState, now: float) -> PoolState:
        gate, ramp, default = self.gates.pool_state(name, now)
        if gate is None:
            return state
        return msgspec.structs.replace(state, gate=gate, ramp=ramp, ramp_default=default)

    def observe_gates(self, record: RequestRecord) -> None:
        """A finished request's evidence for the serving, outcome and collapse gates (from the record telemetry
        gets, built once per request)."""
        if self.gates.settings is None:
            return
        gate = self.gates.pools.get(record.pool)
        bucket = bisect.bisect_left(self.active.policy.learning.concurrency_buckets, max(1, record.concurrency))
        sample = Sample.of(record, bucket, gate.key if gate else "")
        self.gates.observe(sample, time.monotonic(), time.time())
        settings = self.gates.settings
        if self.fleet is not None:  # appended here, flushed off the request path
            if settings.outcome is not None and sample.ok:
                self.fleet.served(sample, settings.outcome.ttl_s)  # any replica takes its outcome
            if settings.serving is not None or settings.collapse is not None:
                self.fleet.observed(sample)  # every replica's ramp and collapse windows see it

    def gate_tick(self) -> None:
        """Sync the gates with the pools' current pair keys, start the equivalence runs that are due, and
        publish what changed (logs, metrics, the next snapshot)."""
        policy = self.active.policy
        now = time.monotonic()
        if policy.gates is not None:
            paired = {name: version for name, version in self.active.pair_versions.items()
                      if version and policy.pools[name].proposer != "none"}
            self.gates.sync(self.backend.pool_keys(paired), now, time.time())
            for pool in self.gates.due(now):
                self.spawn(self._run_gate(pool, self.gates.started(pool)))
        self.publish_gates(now)

    def publish_gates(self, now: float) -> None:
        """Log and count the gates' state changes; a change reaches the next decision's snapshot."""
        events = self.gates.drain()
        if events:
            self.telemetry.record_gate_events([gate_event_view(e) for e in events])
            self._dirty = True
            self._snapshot_at = 0.0  # a verdict takes effect on the next request, not a snapshot age later
        views = gate_views(self.gates, now)
        if views or self._gates_shown:  # without gates, nothing to export (once more after they go: the clear)
            self.telemetry.set_gates(views)
        self._gates_shown = bool(views)

    async def _fleet_gate(self, pool: str, key: str) -> tuple[bool, str | None]:
        """In a fleet: (done, lease holder). Done when the fleet's verdict for this key was adopted, or another
        replica holds the run's lease (this one waits for its verdict); else this replica runs the canaries
        under the lease it returns (None: the store is unreachable, the run is local)."""
        fleet = self.fleet
        gate = self.gates.pools.get(pool)
        if fleet is None or not fleet.up or gate is None:
            return False, None
        try:
            shared = await fleet.gates.verdict(pool, key) if gate.verdict is None else None
            if shared is not None:  # a replica that starts or restarts reads the verdict instead of re-running
                self.gates.finished(pool, key, shared, time.monotonic(), time.time())
                self.gate_tick()
                return True, None
            holder = await fleet.gates.acquire(pool, key, GATE_LEASE_S)
        except FleetDown:
            return False, None
        if holder is None:
            self.gates.postpone(pool, key, time.monotonic() + fleet.interval,
                                "another replica of the fleet runs the equivalence gate; waiting for its verdict")
            return True, None
        return False, holder

    async def _renew_lease(self, pool: str, key: str, holder: str) -> None:
        assert self.fleet is not None
        while True:
            await asyncio.sleep(GATE_LEASE_S / 3)
            with contextlib.suppress(FleetDown):
                await self.fleet.gates.renew(pool, key, holder, GATE_LEASE_S)

    async def _run_gate(self, pool: str, key: str) -> None:
        done, holder = await self._fleet_gate(pool, key)
        if done:
            return
        renewer = asyncio.get_running_loop().create_task(self._renew_lease(pool, key, holder)) if holder else None
        try:
            async with self._gate_run:  # one run at a time: canaries load the same workers users are on
                policy = self.active.policy
                assert policy.gates is not None
                verdict = await check_pool(policy, pool, self.backend, self.canaries, policy.gates.equivalence)
        except Exception as exc:  # noqa: BLE001 - a run that breaks is an error verdict, never a stuck gate
            log.exception("pair_gate_run_failed", pool=pool)
            verdict = Verdict(passed=False, error=True, reason=f"the gate run raised {type(exc).__name__}: {exc}")
        finally:
            if renewer is not None:
                renewer.cancel()
        if holder is not None and self.fleet is not None and not verdict.error:
            try:
                if not await self.fleet.gates.publish_verdict(pool, key, holder, verdict):
                    # fenced: this replica's lease expired and another took the run; its verdict is the fleet's
                    log.warning("pair_gate_lease_lost", pool=pool, key=key)
                    verdict = await self.fleet.gates.verdict(pool, key) or verdict
            except FleetDown:
                pass
        self.gates.finished(pool, key, verdict, time.monotonic(), time.time())
        self.gate_tick()

    async def _gate_loop(self) -> None:
        while True:
            try:
                self.gate_tick()
            except Exception:  # noqa: BLE001 - the gates must outlive one bad round
                log.exception("pair_gate_tick_failed")
            await asyncio.sleep(GATE_TICK_S)
