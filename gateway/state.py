"""Everything the gateway holds between requests, in one object created by ``create_app``.

``Active`` is one policy version with what is derived from it (keys, header names, limiters); a reload
builds a new ``Active`` and swaps the reference between requests, so a request keeps the version it
started with. The decision snapshot is rebuilt at most every ``snapshot_max_age_s`` (and only when
something changed), not per request: ``decide`` then costs ~20 us.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog

from gateway.active import Active
from gateway.auth import KeyRing
from gateway.backend import Backend, pool_state, topology
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
from policies.schema import Policy
from policies.snapshot import PoolState, Snapshot, load_concurrency, worker_load
from policies.stats import LearningState, Outcome
from telemetry import Telemetry, otel
from telemetry.record import RequestRecord

log = structlog.get_logger("specgate.gateway")

GATE_TICK_S = 0.5  # how often the pair gates sync with the workers' identities and start due runs


class GatewayState:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.path = Path(settings.policy_path)
        policy, version = read_policy(self.path)  # PolicyError: a startup failure, not per request
        self.active = self._build(policy, version, {})
        self.last_reload = ReloadResult(ok=True, at=time.time(), version=version)
        self.learning = LearningState(policy.learning)
        view = policy_view(policy)
        self.telemetry = Telemetry(view, debug_text=settings.debug_log_text)
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
        self.rng = random.Random()
        self.in_flight = 0
        self.exploring: dict[str, int] = {}  # exploration_key -> explorations of it in flight
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
                      limiters=limiters_for(policy.routes, policy.route_names(), old),
                      pair_versions={p: policy.pool_pair_version(p) for p in policy.pools})

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.backend.start()
        self.watcher.start()
        self.gate_tick()  # every gated pool is pending before the first request can be decided
        self.spawn(self._gate_loop())

    async def stop(self) -> None:
        await self.watcher.stop()
        for task in list(self.background):
            task.cancel()
        await self.backend.stop()
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
        """Count an exploration in flight (+1 when decided, -1 when it finishes, whatever happened)."""
        n = self.exploring.get(key, 0) + delta
        if n > 0:
            self.exploring[key] = n
        else:
            self.exploring.pop(key, None)

    # -- decisions -----------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        now = time.monotonic()
        age = now - self._snapshot_at
        if self._snapshot is None or age >= self.settings.snapshot_max_age_s or \
                (self._dirty and age >= self.settings.snapshot_max_age_s / 2):
            pools = self.backend.pool_snapshots(now)
            states = {name: self._gated(name, pool_state(s), now) for name, s in pools.items()}
            self._snapshot = self.learning.snapshot(now, states, load_concurrency(self.in_flight, states))
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
        self.gates.observe(Sample.of(record, bucket, gate.key if gate else ""), time.monotonic(), time.time())

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

    async def _run_gate(self, pool: str, key: str) -> None:
        try:
            async with self._gate_run:  # one run at a time: canaries load the same workers users are on
                policy = self.active.policy
                assert policy.gates is not None
                verdict = await check_pool(policy, pool, self.backend, self.canaries, policy.gates.equivalence)
        except Exception as exc:  # noqa: BLE001 - a run that breaks is an error verdict, never a stuck gate
            log.exception("pair_gate_run_failed", pool=pool)
            verdict = Verdict(passed=False, error=True, reason=f"the gate run raised {type(exc).__name__}: {exc}")
        self.gates.finished(pool, key, verdict, time.monotonic(), time.time())
        self.gate_tick()

    async def _gate_loop(self) -> None:
        while True:
            try:
                self.gate_tick()
            except Exception:  # noqa: BLE001 - the gates must outlive one bad round
                log.exception("pair_gate_tick_failed")
            await asyncio.sleep(GATE_TICK_S)
