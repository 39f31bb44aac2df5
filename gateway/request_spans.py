"""A request's OpenTelemetry spans in the gateway (set-up and conventions: ``telemetry/otel.py``).

Not the replay recording (``gateway/tracing.py``). Built only when trace export is configured
(``GatewayState.otel`` is not None); otherwise ``serve`` holds None and pays one ``is None`` test per hook.

    <client's span, from its traceparent>
      └─ "chat MODEL" (SERVER): the request, arrival to its end; gen_ai.* and specgate.* attributes
           ├─ admit      read, auth, parse, features, model and window checks, limits
           ├─ decide     slice and policy decision
           ├─ dispatch   one per worker attempt (CLIENT): worker, pool, attempt number; a failed one has status
           │             ERROR and error.type; the worker's own span is this span's child (traceparent)
           └─ relay      the answer: the stream from its first chunk to its end, or a whole answer's hand-over

The request span's attributes are read from ``Finished`` and its ``RequestRecord`` (the values the answer's
``specgate`` object and the metrics carry), once, when the request ends.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from telemetry import otel

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from gateway.stages import Finished
    from telemetry.otel import Tracing
    from telemetry.record import RequestRecord


class RequestSpans:
    """The spans of one request; ``stage`` closes a child span from the previous mark to now."""

    __slots__ = ("_tracer", "root", "_ctx", "_mark", "_endpoint", "recording", "_unsampled")

    def __init__(self, tracing: Tracing, headers: Any, endpoint: str) -> None:
        self._tracer = tracing.tracer
        self._endpoint = endpoint
        self._mark = time.time_ns()
        op = otel.operation(endpoint)
        parent = otel.extract(headers)
        self._unsampled: dict[str, str] | None = None
        self.root: Span | None = None
        if parent is None:  # a new trace: the sampler decides before any span is built
            trace_id, sampled = tracing.new_root(op)
            if not sampled:
                self.recording = False
                self._unsampled = otel.unsampled_parent(trace_id)
                return
        self.root = self._tracer.start_span(
            op, context=parent, kind=otel.server_kind(), start_time=self._mark,
            attributes={"gen_ai.operation.name": op, "gen_ai.provider.name": "specgate"})
        self._ctx = otel.child_context(self.root)
        # not sampled (OTEL_TRACES_SAMPLER, or the client's traceparent says so): no child span or attribute is
        # built; the worker still gets a traceparent, which says so
        self.recording = self.root.is_recording()

    def stage(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        if not self.recording:
            return
        now = time.time_ns()
        span = self._tracer.start_span(name, context=self._ctx, start_time=self._mark, attributes=attributes)
        span.end(end_time=now)
        self._mark = now

    def attempt(self, number: int, pool: str, proposer: str, draft_tokens: int, worker: str, rid: str
                ) -> tuple[Span | None, dict[str, str]]:
        """A dispatch attempt's span (None when not sampled), and the headers that make the worker's span its
        child."""
        if not self.recording:
            return None, self._unsampled if self.root is None else otel.inject(self.root)
        span = self._tracer.start_span("dispatch", context=self._ctx, kind=otel.client_kind(), attributes={
            "specgate.attempt": number, "specgate.pool": pool, "specgate.proposer": proposer,
            "specgate.draft_tokens": draft_tokens, "server.address": worker, "specgate.worker_rid": rid})
        return span, otel.inject(span)

    @staticmethod
    def attempt_failed(span: Span, error_type: str, message: str) -> None:
        otel.fail(span, error_type, message)
        span.end()

    def dispatched(self) -> None:
        """The answer starts now (the relay span starts here)."""
        self._mark = time.time_ns()

    def finish(self, f: Finished, record: RequestRecord) -> None:
        """Close the relay span (when a worker answered) and the request span, with its attributes."""
        if not self.recording:
            return
        if f.dispatched is not None:
            self.stage("relay", {"specgate.stream": f.stream})
        root = self.root
        model = f.admitted.features.model if f.admitted is not None else ""
        if model:
            root.update_name(f"{otel.operation(self._endpoint)} {model}")
        d = f.decision
        body = f.admitted.body if f.admitted is not None else {}
        r = record
        root.set_attributes(otel.attributes({
            "gen_ai.request.model": model or None,
            "gen_ai.request.max_tokens": body.get("max_completion_tokens", body.get("max_tokens")),
            "gen_ai.request.temperature": body.get("temperature"),
            "gen_ai.usage.input_tokens": r.prompt_tokens if f.dispatched is not None else None,
            "gen_ai.usage.output_tokens": r.completion_tokens if f.dispatched is not None else None,
            "http.response.status_code": r.http_status,
            "specgate.request_id": r.request_id,
            "specgate.status": r.status,
            "specgate.route": r.route or None,
            "specgate.slice": r.slice or None,
            "specgate.pool": r.pool or None,
            "specgate.rule": r.rule or None,
            "specgate.reason": r.reason or None,
            "specgate.proposer": r.proposer if d is not None else None,
            "specgate.draft_tokens": r.draft_tokens if d is not None else None,
            "specgate.explored": d.explored if d is not None else None,
            "specgate.exploration": r.exploration,
            "specgate.fallback": r.fallback if d is not None else None,
            "specgate.retries": r.retries,
            "specgate.worker": r.worker or None,
            "specgate.verify_rounds": r.verify_ct,
            "specgate.accept_length": r.accept_length,
            "specgate.draft_tokens_proposed": r.num_proposed_drafts,
            "specgate.draft_tokens_accepted": r.num_correct_drafts,
            "specgate.ttft_ms": r.ttft_s * 1e3 if r.ttft_s is not None else None,
            "specgate.tpot_ms": r.tpot_s * 1e3 if r.tpot_s is not None else None,
            "specgate.overhead_ms": r.overhead_s * 1e3,
            "specgate.slo.ttft_ms": r.slo_ttft_s * 1e3 if r.slo_ttft_s is not None else None,
            "specgate.slo.tpot_ms": r.slo_tpot_s * 1e3 if r.slo_tpot_s is not None else None,
            "specgate.slo_met": r.slo_met,
        }))
        if r.status != "ok":
            otel.fail(root, r.error_type or r.status, r.error_message or r.status)
        root.end()

