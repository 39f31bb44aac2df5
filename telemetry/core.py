"""``Telemetry``: the one object the gateway hands every finished request, pool state, gate event and policy change.

It fans each ``RequestRecord`` out to Prometheus counters and histograms, one structured log line, and
the dashboard's in-memory history. Labels are bounded by the policy in force (:mod:`telemetry.labels`),
so a client can never create a series. Single event loop, no locks: every method is called from the
gateway's loop, including ``metrics_response`` (the scrape handler). The policy, the pools and the pair
gates come in as views (:mod:`telemetry.views`, built by ``gateway/telemetry_views.py``), never the
``Policy``, the pools or the ``GateBook`` themselves.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from telemetry.derive import SpecCounts, is_speculative, spec_counts
from telemetry.labels import LabelSets
from telemetry.logs import log_gate_event, log_request
from telemetry.metrics import Metrics
from telemetry.record import RequestRecord
from telemetry.series import History
from telemetry.speedup import cells, load_label, sample
from telemetry.views import GateEventView, GateView, PolicyView, PoolView, WorkerView


def _pair_state(verified: bool | None) -> str:
    return "unknown" if verified is None else ("verified" if verified else "mismatch")


class Telemetry:
    """Metrics, logs and dashboard history of one gateway. ``registry``: a private one by default."""

    def __init__(self, policy: PolicyView, *, debug_text: bool = False,
                 registry: CollectorRegistry | None = None, history: History | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.debug_text = debug_text
        self.logger = structlog.get_logger("specgate")
        self.history = history if history is not None else History()
        self.policy = policy
        self.labels = LabelSets.from_policy(policy)
        self._proposer_of = {p.name: p.proposer for p in policy.pools}
        self.policy_state: dict[str, Any] = {}
        # (route, slice, pool) -> [accepted per position, reached per position], since start
        self.positions: dict[tuple[str, str, str], list[list[int]]] = {}
        self.pools: list[dict[str, Any]] = []
        self.gates: list[dict[str, Any]] = []
        self.evidence: dict[tuple[str, str], int] = {}  # (route, slice) -> options taught by counterfactuals
        self.started = time.time()
        # labelled children, made on first use like ``labels()`` (no zero series appear early), then
        # reused: ``labels()`` costs a lock and validation per call, several per request. The label
        # sets are bounded by the policy, so this stays small.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.set_policy(policy, version=policy.digest, reload_ok=True)

    # -- requests ----------------------------------------------------------------------------------

    def observe(self, record: RequestRecord) -> None:
        """Count one finished (or failed) request everywhere."""
        lab = self.labels
        key = (lab.route(record.route), lab.slice(record.slice), lab.pool(record.pool),
               lab.proposer(record.proposer))
        rule = lab.rule(record.rule)
        m = self.metrics
        child = self._child
        child(m.requests, (*key, rule, lab.status(record.status))).inc()
        if record.exploration is not None:
            child(m.explorations, (*key, lab.exploration(record.exploration))).inc()
        for step in record.resumes:
            child(m.resumes, (key[0], lab.pool(step.pool or record.pool), step.outcome)).inc()
        child(m.prompt_tokens, key).inc(record.prompt_tokens)
        child(m.output_tokens, key).inc(record.completion_tokens)
        if record.slo_met is True:
            child(m.slo_met, key).inc()
        elif record.slo_met is False:
            child(m.slo_missed, key).inc()
        for hist, value in ((m.ttft, record.ttft_s), (m.tpot, record.tpot_s), (m.e2e, record.e2e_s)):
            if value is not None:
                child(hist, key).observe(value)
        if record.overhead_s is not None:
            m.overhead.observe(record.overhead_s)
        counts = spec_counts(record)
        if counts is not None:
            self._observe_spec(key, counts, record.accept_length)
        log_request(self.logger, record, debug_text=self.debug_text)
        self._remember(key, rule, record, counts)

    def _child(self, metric: Any, labels: tuple[str, ...]) -> Any:
        found = self._children.get((id(metric), labels))
        if found is None:
            found = self._children[(id(metric), labels)] = metric.labels(*labels)
        return found

    def _observe_spec(self, key: tuple[str, ...], counts: SpecCounts, accept_length: float | None) -> None:
        m, child = self.metrics, self._child
        child(m.rounds, key).inc(counts.rounds)
        child(m.draft_tokens, key).inc(counts.draft_tokens)
        child(m.accepted_tokens, key).inc(counts.accepted_tokens)
        for j, (acc, reached) in enumerate(zip(counts.accepted_per_position, counts.reached_per_position)):
            child(m.position_accepted, (*key, str(j + 1))).inc(acc)
            child(m.position_reached, (*key, str(j + 1))).inc(reached)
        if accept_length is None:
            accept_length = 1.0 + counts.accepted_tokens / counts.rounds
        child(m.accept_length, key).observe(accept_length)

    def _remember(self, key: tuple[str, ...], rule: str, record: RequestRecord, counts: SpecCounts | None) -> None:
        route, slice_, pool = key[0], key[1], key[2]
        ok = record.status == "ok"
        sums: dict[str, float] = {"requests": 1, "ok": int(ok), "errors": int(not ok), "explored": int(record.explored),
                                  "slo_met": int(record.slo_met is True), "slo_missed": int(record.slo_met is False),
                                  "output_tokens": record.completion_tokens,
                                  # answers another worker continued after theirs failed (gateway/resume.py)
                                  "resumed": int(any(r.outcome == "ok" for r in record.resumes))}
        if counts is not None:
            sums.update(rounds=counts.rounds, accepted=counts.accepted_tokens, drafts=counts.draft_tokens)
            acc, reached = self.positions.setdefault((route, slice_, pool), [[], []])
            for j, (a, r) in enumerate(zip(counts.accepted_per_position, counts.reached_per_position)):
                if j == len(acc):
                    acc.append(0)
                    reached.append(0)
                acc[j] += a
                reached[j] += r
        if record.tpot_s is not None:
            mode = "spec" if is_speculative(record) else "plain"
            sums[f"tpot_{mode}_sum"] = record.tpot_s
            sums[f"tpot_{mode}_n"] = 1
        if record.ttft_s is not None:
            sums.update(ttft_sum=record.ttft_s, ttft_n=1)
        at = record.timestamp or time.time()
        self.history.add_request(at, route, slice_, rule, sums)
        speed = sample(record, self.policy.load_buckets) if slice_ else None
        if speed is not None:
            self.history.add_speed(at, route, slice_, *speed)

    def observe_evidence(self, route: str, slice_: str, options: int, seconds: float) -> None:
        """One answer's full-information evidence: ``options`` taught, ``seconds`` of the evidence thread."""
        if options:
            self._child(self.metrics.counterfactual, (route, slice_)).inc(options)
        self.metrics.counterfactual_seconds.inc(seconds)
        key = (route, slice_)
        self.evidence[key] = self.evidence.get(key, 0) + options

    def count_trace(self, result: str) -> None:
        """One finished request as the trace recorder saw it; ``result`` is one of a fixed set (the metric's
        help lists it), so it cannot grow the series."""
        self._child(self.metrics.trace_requests, (result,)).inc()

    def count_otel_dropped(self, traces: int, reason: str) -> None:
        """Sampled requests' spans the gateway's trace export dropped (``telemetry/otel_pipe.SpanPipe``); ``reason``
        is buffer_full, exporter_gone, shutdown or export_failed."""
        self._child(self.metrics.otel_dropped, (reason,)).inc(traces)

    def observe_overhead(self, seconds: float) -> None:
        """Gateway overhead measured outside a record. Use this OR ``RequestRecord.overhead_s`` for a
        request, not both, or it is counted twice."""
        self.metrics.overhead.observe(seconds)

    # -- pools and policy --------------------------------------------------------------------------

    def set_pools(self, pools: Iterable[PoolView], *, now: float | None = None) -> None:
        """Replace every pool and worker gauge with the monitor's latest view (pools the policy does not
        name are exported as ``other``)."""
        m, lab = self.metrics, self.labels
        m.clear_pool_gauges()
        current: list[dict[str, Any]] = []
        for snap in sorted(pools, key=lambda p: p.name):
            pool = lab.pool(snap.name)
            m.pool_workers.labels(pool).set(snap.workers)
            m.pool_healthy.labels(pool).set(snap.healthy_workers)
            m.pool_running.labels(pool).set(snap.running)
            m.pool_waiting.labels(pool).set(snap.waiting)
            m.pool_in_flight.labels(pool).set(snap.in_flight)
            if snap.kv_usage is not None:
                m.pool_kv.labels(pool).set(snap.kv_usage)
            if snap.accept_length is not None:
                m.pool_accept_length.labels(pool).set(snap.accept_length)
            m.pool_pair.labels(pool).state(_pair_state(snap.pair_verified))
            worker_rows = [self._set_worker(pool, w) for w in snap.worker_states]
            current.append({"pool": pool, "proposer": self._proposer_of.get(snap.name, "other"),
                            "workers": snap.workers, "healthy_workers": snap.healthy_workers,
                            "running": snap.running, "waiting": snap.waiting, "in_flight": snap.in_flight,
                            "kv_usage": snap.kv_usage, "accept_length": snap.accept_length,
                            "pair": _pair_state(snap.pair_verified), "worker_states": worker_rows})
        self.pools = current
        self.history.add_pools(now if now is not None else time.time(), {
            row["pool"]: {"running": row["running"], "waiting": row["waiting"], "kv_usage": row["kv_usage"],
                          "healthy_workers": row["healthy_workers"]} for row in current})

    def _set_worker(self, pool: str, worker: WorkerView) -> dict[str, Any]:
        m = self.metrics
        label = (pool, self.labels.worker(worker.url))
        m.worker_healthy.labels(*label).set(int(worker.healthy))
        if worker.running is not None:
            m.worker_running.labels(*label).set(worker.running)
        if worker.waiting is not None:
            m.worker_waiting.labels(*label).set(worker.waiting)
        if worker.kv_usage is not None:
            m.worker_kv.labels(*label).set(worker.kv_usage)
        return {"worker": label[1], "healthy": worker.healthy, "last_error": worker.last_error,
                "running": worker.running, "waiting": worker.waiting, "kv_usage": worker.kv_usage,
                "mismatches": list(worker.mismatches)}

    # -- pair gates --------------------------------------------------------------------------------

    def record_gate_events(self, events: Iterable[GateEventView]) -> None:
        """Each pair gate event once (the gateway drains its ``GateBook``): one ``pair_gate`` log line, one
        count by pool, gate and state, and a collapse alert when the collapse detector made the pool degraded."""
        m, lab, child = self.metrics, self.labels, self._child
        for event in events:
            pool = lab.pool(event.pool)
            child(m.gate_transitions, (pool, lab.gate(event.gate), lab.gate_state(event.state))).inc()
            if event.gate == "collapse" and event.state == "degraded":
                child(m.collapse_alerts, (pool,)).inc()
            log_gate_event(self.logger, event)

    def set_gates(self, views: Mapping[str, GateView]) -> None:
        """Replace the gate state and ramp gauges, and the dashboard's gate rows, with the book's latest view
        (a pool the view no longer has, e.g. after a policy reload, loses its series)."""
        m, lab = self.metrics, self.labels
        m.clear_gate_gauges()
        for name, view in sorted(views.items()):
            pool = lab.pool(name)
            m.gate_state.labels(pool).state(view.state)
            self._child(m.collapse_alerts, (pool,))  # exported at 0 before the first collapse
            for region in view.regions:
                m.gate_share.labels(pool, lab.slice(region.slice), lab.bucket(region.bucket)).set(region.share)
        edges = self.policy.load_buckets
        self.gates = [_gate_row(view, edges) for _, view in sorted(views.items())]

    def set_policy(self, policy: PolicyView, *, version: str, reload_ok: bool, error: str | None = None) -> None:
        """Record a (re)load. ``policy``/``version``: the policy now in force (the old one when the reload
        failed); label sets follow it, so names a new policy drops become ``other`` from now on."""
        m = self.metrics
        self.policy = policy
        self.labels = LabelSets.from_policy(policy)
        self._proposer_of = {p.name: p.proposer for p in policy.pools}
        m.policy.info({"version": version})
        m.reload_ok.set(1 if reload_ok else 0)
        now = time.time()
        m.reload_time.set(now)
        m.reloads.labels("ok" if reload_ok else "error").inc()
        self.policy_state = {"version": version, "reload_ok": reload_ok, "error": error, "at": now}
        if not reload_ok:
            self.logger.error("policy_reload_failed", version_in_force=version, cause=error)

    # -- export ------------------------------------------------------------------------------------

    def metrics_response(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def speedup(self, now: float) -> dict[str, Any]:
        """The realised speedup table (:func:`telemetry.speedup.cells`) over the window the series cover:
        ``window_s``, ``edges`` (the load bucket edges in force), ``loads`` and ``cells``."""
        sums, window_s = self.history.speed_sums(now)
        return {"window_s": window_s, "edges": list(self.policy.load_buckets),
                **cells(sums, self.policy.load_buckets)}

    def dashboard_data(self, now: float | None = None) -> dict[str, Any]:
        """What ``GET /dashboard/data`` returns: the policy, time series, the speedup table, acceptance curves,
        pools and pair gates."""
        now = now if now is not None else time.time()
        policy = self.policy
        return {
            "now": now,
            "started": self.started,
            "policy": {**self.policy_state, "routes": sorted(self.labels.routes),
                       "slices": sorted(self.labels.slices), "rules": list(policy.rules),
                       "pools": {p.name: {"proposer": p.proposer, "k": list(p.k_range)} for p in policy.pools},
                       "slo": {r.name: msgspec.to_builtins(r.slo)
                               for r in sorted(policy.routes, key=lambda r: r.name)}},
            "series": self.history.export(now),
            "speedup": self.speedup(now),
            "positions": [{"route": r, "slice": s, "pool": p, "accepted": acc, "reached": reached}
                          for (r, s, p), (acc, reached) in sorted(self.positions.items())],
            "pools": self.pools,
            "gates": self.gates,
            "evidence": [{"route": r, "slice": s, "options": n} for (r, s), n in sorted(self.evidence.items())],
        }


def _gate_row(view: GateView, edges: tuple[int, ...]) -> dict[str, Any]:
    """A gate view for the dashboard, each region with the loads its bucket holds ("3-4" requests in flight)."""
    row = msgspec.to_builtins(view)
    for region in row["regions"]:
        b = region["bucket"]  # bisect_left over the edges: len(edges) is the bucket above the last one
        region["load"] = load_label(edges[b] if b < len(edges) else None, edges)
    return row
