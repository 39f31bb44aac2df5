"""Prometheus metrics of the gateway: counters in, rates derived in PromQL (CONTRIBUTING.md #8).

Every collector lives in one private ``CollectorRegistry`` per ``Telemetry`` (tests and several apps
in one process never collide). Labels ``route, slice, pool, proposer`` (``L`` below) are bounded by
:mod:`telemetry.labels`. Derived quantities, with ``$L`` standing for ``route, slice, pool, proposer``:

- Acceptance rate (accepted drafts per proposed draft)::

    sum by ($L) (rate(specgate_spec_accepted_tokens_total[5m]))
      / sum by ($L) (rate(specgate_spec_draft_tokens_total[5m]))

- Mean accept length (tokens committed per verification round, bonus token included; plain = 1)::

    1 + sum by ($L) (rate(specgate_spec_accepted_tokens_total[5m]))
          / sum by ($L) (rate(specgate_spec_rounds_total[5m]))

- Conditional acceptance at draft position j (accepted given the previous j-1 were)::

    sum by ($L, position) (rate(specgate_spec_position_accepted_tokens_total[5m]))
      / sum by ($L, position) (rate(specgate_spec_position_reached_total[5m]))

- SLO goodput of a route (DistServe: completed requests/s meeting both TTFT and TPOT SLO)::

    sum by (route) (rate(specgate_slo_met_total[5m]))

- SLO attainment::

    sum by (route) (rate(specgate_slo_met_total[5m]))
      / (sum by (route) (rate(specgate_slo_met_total[5m])) + sum by (route) (rate(specgate_slo_missed_total[5m])))

- Throughput (output tokens/s) next to goodput: ``sum by (route) (rate(specgate_output_tokens_total[5m]))``
- Decisions by rule: ``sum by (rule) (rate(specgate_requests_total[5m]))``
- Share of a slice's traffic that ``auto`` spends exploring (the running cost of learning)::

    sum by (route, slice) (rate(specgate_explorations_total[5m]))
      / sum by (route, slice) (rate(specgate_requests_total[5m]))
- Error ratio: ``sum(rate(specgate_requests_total{status!="ok"}[5m])) / sum(rate(specgate_requests_total[5m]))``
- Trace recording (``tracing:``): share of the requests it saw that were written, and why others were not::

    sum(rate(specgate_trace_requests_total{result="recorded"}[5m])) / sum(rate(specgate_trace_requests_total[5m]))
    sum by (result) (rate(specgate_trace_requests_total{result!="recorded"}[5m]))
- OpenTelemetry export (docs/operating.md, "Tracing"): sampled requests' spans the gateway had to drop::

    sum by (reason) (rate(specgate_otel_dropped_traces_total[5m]))
- Pair gates (``specgate_pair_gate_state`` is an Enum: its state label is named like the metric): pools held
  out, and acceptance collapses caught in the last 10 minutes::

    specgate_pair_gate_state{specgate_pair_gate_state=~"failed|pending"} == 1
    increase(specgate_pair_collapse_alerts_total[10m]) > 0
- Latency quantiles, e.g. p95 TPOT per pool::

    histogram_quantile(0.95, sum by (pool, le) (rate(specgate_time_per_output_token_seconds_bucket[5m])))
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info

L = ("route", "slice", "pool", "proposer")

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
ACCEPT_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0)
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
PAIR_STATES = ("verified", "mismatch", "unknown")
# the pair gates (gateway/gates/book.py): a pool's states, and the gates whose events move it
GATE_STATES = ("pending", "passed", "failed", "degraded")
GATES = ("equivalence", "serving", "outcome", "collapse", "version")


class Metrics:
    """All ``specgate_*`` collectors, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            "specgate_requests", "Finished requests by decision rule and status class "
            "(status: ok|client_error|rate_limited|upstream_error|aborted|unavailable).",
            L + ("rule", "status"), registry=r)
        self.explorations = Counter(
            "specgate_explorations", "Finished requests whose auto decision explored: measured an option (its pool "
            "and k, or plain decoding) instead of serving the best posterior mean; kind: cold (never measured in "
            "the request's context) or thompson (a posterior draw).", L + ("kind",), registry=r)
        self.rounds = Counter("specgate_spec_rounds", "Speculative verification rounds.", L, registry=r)
        self.draft_tokens = Counter("specgate_spec_draft_tokens", "Draft tokens proposed.", L, registry=r)
        self.accepted_tokens = Counter("specgate_spec_accepted_tokens", "Draft tokens accepted by the target.",
                                       L, registry=r)
        self.position_accepted = Counter(
            "specgate_spec_position_accepted_tokens",
            "Draft tokens accepted at draft position (1-based, positions 1-16).", L + ("position",), registry=r)
        self.position_reached = Counter(
            "specgate_spec_position_reached",
            "Rounds that reached draft position (all earlier drafts accepted), positions 1-16.",
            L + ("position",), registry=r)
        self.resumes = Counter(
            "specgate_resumes", "Tries to resume an answer on another worker after its worker failed mid-answer, "
            "by the pool that took over (the served pool when none did) and outcome: ok | failed | no_worker | "
            "no_ids | limit | deadline | structured | penalties | request_error (gateway/resume.py).",
            ("route", "pool", "outcome"), registry=r)
        self.counterfactual = Counter(
            "specgate_counterfactual_observations", "Options of an auto rule a served greedy answer taught the "
            "learner about without serving them (full-information evidence, gateway/evidence.py), by route and "
            "slice.", ("route", "slice"), registry=r)
        self.counterfactual_seconds = Counter(
            "specgate_counterfactual_seconds", "Seconds the gateway's evidence thread spent computing and pricing "
            "counterfactual rounds (off the request path).", registry=r)
        self.output_tokens = Counter("specgate_output_tokens", "Completion tokens returned.", L, registry=r)
        self.prompt_tokens = Counter("specgate_prompt_tokens", "Prompt tokens received.", L, registry=r)
        self.slo_met = Counter("specgate_slo_met", "Completed requests that met both the route's TTFT and "
                               "TPOT SLO (DistServe goodput).", L, registry=r)
        self.slo_missed = Counter("specgate_slo_missed", "Completed requests that missed the route's TTFT "
                                  "or TPOT SLO.", L, registry=r)
        self.ttft = Histogram("specgate_time_to_first_token_seconds", "Gateway-observed time to first token.",
                              L, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("specgate_time_per_output_token_seconds", "Time per output token after the "
                              "first: streamed, (e2e - ttft) / (completion_tokens - 1) at the gateway; a whole "
                              "answer, the worker's decode time / (completion_tokens - 1) when it reports one.",
                              L, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("specgate_request_duration_seconds", "End-to-end request latency at the gateway.",
                             L, buckets=E2E_BUCKETS, registry=r)
        self.accept_length = Histogram(
            "specgate_spec_accept_length", "Mean accept length of one speculative request (tokens per round, "
            "bonus included; the worker reports per-request totals, not rounds).", L,
            buckets=ACCEPT_LENGTH_BUCKETS, registry=r)
        self.overhead = Histogram("specgate_gateway_overhead_seconds", "Time the gateway itself added to a "
                                  "request (parse, decide, dispatch, relay).", buckets=OVERHEAD_BUCKETS,
                                  registry=r)
        # gauges: pool and worker state, replaced wholesale by each set_pools
        self.pool_workers = Gauge("specgate_pool_workers", "Workers configured in the pool.", ["pool"],
                                  registry=r)
        self.pool_healthy = Gauge("specgate_pool_healthy_workers", "Healthy workers in the pool.", ["pool"],
                                  registry=r)
        self.pool_running = Gauge("specgate_pool_running_requests", "Requests running on the pool's workers.",
                                  ["pool"], registry=r)
        self.pool_waiting = Gauge("specgate_pool_waiting_requests", "Requests queued on the pool's workers.",
                                  ["pool"], registry=r)
        self.pool_in_flight = Gauge("specgate_pool_in_flight_requests", "Requests the gateway has in flight "
                                    "to the pool.", ["pool"], registry=r)
        self.pool_kv = Gauge("specgate_pool_kv_usage_ratio", "KV cache usage of the pool (0-1; max over healthy "
                             "workers unless the pool is set to mean).", ["pool"], registry=r)
        self.pool_accept_length = Gauge("specgate_pool_accept_length", "Worker-reported mean accept length.",
                                        ["pool"], registry=r)
        self.pool_pair = Enum("specgate_pool_pair_verification", "Pair identity of the pool's healthy workers "
                              "against the policy's pair.", ["pool"], states=list(PAIR_STATES), registry=r)
        self.worker_healthy = Gauge("specgate_worker_healthy", "1 when the worker passes its health checks.", ["pool", "worker"], registry=r)
        self.worker_running = Gauge("specgate_worker_running_requests", "Requests running on the worker.",
                                    ["pool", "worker"], registry=r)
        self.worker_waiting = Gauge("specgate_worker_waiting_requests", "Requests queued on the worker.",
                                    ["pool", "worker"], registry=r)
        self.worker_kv = Gauge("specgate_worker_kv_usage_ratio", "KV cache usage of the worker (0-1).",
                               ["pool", "worker"], registry=r)
        # pair gates: the state and ramp gauges are replaced wholesale by each set_gates; the counters stay
        self.gate_state = Enum("specgate_pair_gate_state", "The pool's pair gate state: pending (the "
                               "equivalence gate has not passed: no user traffic), passed, failed (held out), "
                               "degraded (acceptance collapsed).", ["pool"], states=list(GATE_STATES), registry=r)
        self.gate_share = Gauge("specgate_pair_gate_ramp_share", "Share of the policy's requests for the pool that "
                                "the serving gate sends it in one load region (slice x concurrency bucket index; "
                                "0: closed).", ["pool", "slice", "bucket"], registry=r)
        self.gate_transitions = Counter(
            "specgate_pair_gate_transitions", "Pair gate events by the gate that moved the pool (equivalence|serving|"
            "outcome|collapse|version) and the state after it (a serving event can keep the state: a load region "
            "opened or closed).", ["pool", "gate", "state"], registry=r)
        self.collapse_alerts = Counter(
            "specgate_pair_collapse_alerts", "Acceptance collapses caught by the collapse detector (the pool went "
            "degraded); 0 from the pool's first gate view on, so increase() sees the first one.", ["pool"],
            registry=r)
        # policy
        self.policy = Info("specgate_policy", "The policy in force.", registry=r)
        self.reload_ok = Gauge("specgate_policy_last_reload_success", "1 when the last policy (re)load "
                               "succeeded, 0 when it failed and the previous policy stayed.", registry=r)
        self.reload_time = Gauge("specgate_policy_last_reload_timestamp_seconds", "When the last policy "
                                 "(re)load was attempted.", registry=r)
        self.reloads = Counter("specgate_policy_reloads", "Policy (re)loads by result (ok|error).", ["result"],
                               registry=r)
        self.trace_requests = Counter(
            "specgate_trace_requests", "Requests finished while trace recording was on, by result: recorded, or "
            "why not (sampled_out|route_excluded|failed|no_ids|unknown_worker|other_revision|invalid|too_large|"
            "write_error).", ["result"], registry=r)
        self.otel_dropped = Counter(
            "specgate_otel_dropped_traces", "Sampled requests whose OpenTelemetry spans were lost, by reason "
            "(buffer_full: the exporter process falls behind; exporter_gone: it died and is restarted; shutdown: not "
            "written before the gateway's shutdown deadline; export_failed: the collector refused them or could not "
            "be reached through the exporter's retries).", ["reason"], registry=r)

    def clear_pool_gauges(self) -> None:
        for gauge in (self.pool_workers, self.pool_healthy, self.pool_running, self.pool_waiting,
                      self.pool_in_flight, self.pool_kv, self.pool_accept_length, self.pool_pair,
                      self.worker_healthy, self.worker_running, self.worker_waiting, self.worker_kv):
            gauge.clear()

    def clear_gate_gauges(self) -> None:
        self.gate_state.clear()
        self.gate_share.clear()
