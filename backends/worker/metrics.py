"""Prometheus metrics under SGLang's names (``sglang:*``), in a private registry.

Counters and histograms are fed from engine events (``observe``); gauges that describe the engine's
current state are read from ``Engine.load()`` when /metrics is scraped (``refresh``), so they are never
stale. ``sglang:spec_accept_length`` / ``spec_accept_rate`` are cumulative over finished requests:
accept_length = sum(completion_tokens) / sum(verify_ct) (bonus included, as SGLang counts it),
accept_rate = sum(correct drafts) / sum(proposed drafts).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from backends.engine.types import EngineLoad, RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)


class WorkerMetrics:
    """Thread-safe: ``observe`` runs on the engine thread, ``render`` on the event loop."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"sglang:{name}", doc, labels, registry=r)

        self.num_running = gauge("num_running_reqs", "Requests decoding now")
        self.num_queue = gauge("num_queue_reqs", "Requests waiting for a running slot")
        self.token_usage = gauge("token_usage", "Used KV positions / max_total_num_tokens")
        self.num_used_tokens = gauge("num_used_tokens", "KV positions in use")
        self.accept_length = gauge("spec_accept_length", "Tokens committed per verification round")
        self.accept_rate = gauge("spec_accept_rate", "Accepted drafts / proposed drafts")
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Time per output token after the first",
                             labels, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens", "Generated tokens", labels, registry=r)
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens", labels, registry=r)
        self.requests = Counter("sglang:num_requests", "Finished requests", labels, registry=r)
        self.spec_verify = Counter("sglang:spec_verify_calls", "Verification rounds", labels, registry=r)
        self.otel_dropped = Counter(  # specgate's own, as on the gateway (telemetry/otel_pipe.SpanPipe)
            "specgate_otel_dropped_traces", "Sampled requests whose OpenTelemetry spans the worker lost, by reason "
            "(buffer_full, exporter_gone, shutdown, export_failed: as on the gateway).", ["reason"],
            registry=r)
        self._model = model_name
        self._lock = threading.Lock()
        self._last_event: dict[str, float] = {}
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) in the throughput window
        self._totals = [0, 0, 0, 0]  # completion tokens, verify rounds, correct drafts, proposed drafts

    def submitted(self, rid: str, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self._model).inc(prompt_tokens)
        with self._lock:
            self._last_event[rid] = time.perf_counter()

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        model = self._model
        with self._lock:
            last = self._last_event.get(out.rid)
            self._last_event[out.rid] = now
        if out.new_token_ids:
            with self._lock:
                self._recent.append((now, len(out.new_token_ids)))
            self.generation_tokens.labels(model).inc(len(out.new_token_ids))
            if len(out.output_ids) == len(out.new_token_ids) and out.stats.first_token_s is not None:
                self.ttft.labels(model).observe(out.stats.first_token_s)
            elif last is not None:
                per_token = (now - last) / len(out.new_token_ids)
                for _ in out.new_token_ids:
                    self.itl.labels(model).observe(per_token)
        if out.finished:
            s = out.stats
            self.requests.labels(model).inc()
            self.spec_verify.labels(model).inc(s.verify_ct)
            if s.e2e_s is not None:
                self.e2e.labels(model).observe(s.e2e_s)
            with self._lock:
                self._last_event.pop(out.rid, None)
                t = self._totals
                t[0] += s.completion_tokens
                t[1] += s.verify_ct
                t[2] += s.num_correct_drafts
                t[3] += s.num_proposed_drafts

    def gen_throughput(self, window_s: float = 10.0) -> float:
        """Tokens per second committed over the last ``window_s`` seconds (SGLang's gen_throughput)."""
        cutoff = time.perf_counter() - window_s
        with self._lock:
            while self._recent and self._recent[0][0] < cutoff:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / window_s

    @property
    def avg_accept_length(self) -> float:
        with self._lock:
            return self._totals[0] / self._totals[1] if self._totals[1] else 0.0

    @property
    def avg_accept_rate(self) -> float:
        with self._lock:
            return self._totals[2] / self._totals[3] if self._totals[3] else 0.0

    def refresh(self, load: EngineLoad) -> None:
        m = self._model
        self.num_running.labels(m).set(load.num_running_reqs)
        self.num_queue.labels(m).set(load.num_waiting_reqs)
        self.num_used_tokens.labels(m).set(load.num_used_tokens)
        self.token_usage.labels(m).set(load.token_usage)
        self.accept_length.labels(m).set(self.avg_accept_length)
        self.accept_rate.labels(m).set(self.avg_accept_rate)

    def render(self) -> bytes:
        return generate_latest(self.registry)
