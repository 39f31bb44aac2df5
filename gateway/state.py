"""Everything the gateway holds between requests, in one object created by ``create_app``.

``Active`` is one policy version with what is derived from it (keys, header names, limiters); a reload
builds a new ``Active`` and swaps the reference between requests, so a request keeps the version it
started with. The decision snapshot is rebuilt at most every ``snapshot_max_age_s`` (and only when
something changed), not per request: ``decide`` then costs ~20 us.
"""

from __future__ import annotations

import asyncio
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
from gateway.gates.driver import GateDriver, canary_problems
from gateway.limits import RouteLimiter, limiters_for
from gateway.reload import PolicyWatcher, ReloadResult, read_policy
from gateway.settings import GatewaySettings
from gateway.telemetry_views import policy_view, pool_views
from gateway.tracing import Recorder, problems, resolve
from policies.features import reads_prompt_repeat, referenced_headers
from policies.schema import Policy, State
from policies.shared_sums import sum_counts
from policies.snapshot import Snapshot, load_concurrency, worker_load
from policies.stats import LearningState, Outcome
from telemetry import Telemetry, otel

log = structlog.get_logger("specgate.gateway")

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
        # the pair gates: their state (self.gates, gateway/gates/book.py) and what drives them (gateway/gates/driver.py)
        self.gate_runs = GateDriver(policy, self.path.parent, self.telemetry, self.fleet, active=lambda: self.active,
                                    backend=lambda: self.backend, spawn=self.spawn, changed=self._gates_changed)
        self.gates = self.gate_runs.book
        if errors := self.tracing_problems(policy):
            raise ValueError("\n".join(errors))  # a startup failure, like an invalid policy
        self.recorder = Recorder(resolve(policy.tracing, settings.trace_path, self.path.parent),
                                 worker_info=lambda url: self.backend.info.get(url),
                                 count=self.telemetry.count_trace)
        self.watcher = PolicyWatcher(self.path, version, apply=self.apply_policy, reject=self.reject_policy,
                                     interval_s=settings.reload_interval_s, check=self.tracing_problems)
        # OpenTelemetry trace export (OTEL_* environment variables) through an exporter process of its own
        # (telemetry/otel.py, otel_pipe.py), started with the gateway; None: off
        self.otel = otel.configure("specgate-gateway", on_drop=self.telemetry.count_otel_dropped)
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
        if self.otel is not None:
            self.otel.start()
        await self.backend.start()
        self.watcher.start()
        if self.fleet is not None:
            # a replica that starts reads the fleet's evidence first, and knows whether the store answers before
            # a gate run is due (a fleet run takes the lease; a run while the store is down is local)
            with contextlib.suppress(FleetDown):  # unreachable: it starts on its local state, and retries
                await self.sync_fleet()
            self.spawn(self._fleet_loop())
            self.spawn(self.fleet.limits_loop())
        self.gate_runs.tick()  # every gated pool is pending before the first request can be decided
        self.spawn(self.gate_runs.loop())

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
            await asyncio.to_thread(self.otel.shutdown)  # the exporter process exports what it holds, and exits

    def spawn(self, coro: Any) -> None:
        """Fire-and-forget work (aborts, closing a stream) that must survive a cancelled request."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # -- reload --------------------------------------------------------------------------------------

    def tracing_problems(self, policy: Policy) -> list[str]:
        """What the policy file alone does not show: an unusable trace path or canary file (a reload with
        either is refused, as an invalid policy is)."""
        return problems(policy, self.settings.trace_path, self.path.parent) + canary_problems(policy, self.path.parent)

    def apply_policy(self, policy: Policy, version: str) -> None:
        self.active = self._build(policy, version, self.active.limiters)
        self.recorder.configure(resolve(policy.tracing, self.settings.trace_path, self.path.parent))
        self.learning.configure(policy.learning)
        self.learning.forget_pair_versions(set(self.active.pair_versions.values()))
        gates_toggled = bool(policy.gates) != bool(self.gates.settings)  # the backend's identity polls follow
        self.gate_runs.configure(policy)  # its canary file was checked by tracing_problems before apply
        if topology(policy) != self.backend.topology or gates_toggled:
            old, self.backend = self.backend, self._backend(policy)
            self.spawn(self._swap_backend(old, self.backend))
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
        self.exploring = sum_counts(self._own_exploring, fleet.remote_exploring)
        self._dirty = True
        self.gate_runs.from_fleet(fleet.take_samples(), reports)

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
            states = {name: self.gate_runs.pool_state(name, pool_state(s), now) for name, s in pools.items()}
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

    def _gates_changed(self) -> None:
        """A gate's verdict or hold takes effect on the next request, not a snapshot age later."""
        self._dirty = True
        self._snapshot_at = 0.0
