"""A request's OpenTelemetry spans in the gateway, recorded as plain values and exported by another process
(``telemetry/otel_pipe.py``; conventions: ``telemetry/otel.py``).

Not the replay recording (``gateway/tracing.py``). Built only when trace export is configured
(``GatewayState.otel`` is not None); otherwise ``serve`` holds None and pays one ``is None`` test per hook.

    <client's span, from its traceparent>
      └─ "chat MODEL" (SERVER): the request, arrival to its end; gen_ai.* and specgate.* attributes
           ├─ admit      read, auth, parse, features, model and window checks, limits
           ├─ decide     slice and policy decision
           ├─ dispatch   one per worker attempt (CLIENT): worker, pool, attempt number; a failed one has status
           │             ERROR and error.type; the worker's own span is this span's child (traceparent)
           └─ relay      the answer: the stream from its first chunk to its end, or a whole answer's hand-over

The sampler decides when the request arrives; an unsampled request records nothing and tells the worker so. A
sampled one's spans are ``WireSpan`` values, shipped as one ``WireTrace`` when the request ends. The request
span's attributes are read from ``Finished`` and its ``RequestRecord`` (the values the answer's ``specgate``
object and the metrics carry), once, then.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from telemetry import otel
from telemetry.otel_pipe import CLIENT, GATEWAY_REQUEST, SERVER, WireSpan

if TYPE_CHECKING:
    from gateway.stages import Finished
    from telemetry.otel import TraceExport
    from telemetry.record import RequestRecord


class Attempt:
    """A dispatch attempt's span while it runs (``dispatch.py``, ``resume.py``): ``end`` when it answered, ``fail``
    when it did not, ``set_attribute`` for what only the caller knows."""

    __slots__ = ("span",)

    def __init__(self, span: WireSpan) -> None:
        self.span = span

    def set_attribute(self, key: str, value: str | bool | int | float) -> None:
        self.span.attributes[key] = value

    def end(self) -> None:
        if self.span.end_ns == 0:
            self.span.end_ns = time.time_ns()

    def fail(self, error_type: str, message: str) -> None:
        self.span.attributes["error.type"] = error_type  # as the semantic conventions name it
        self.span.error = message
        self.end()


class RequestSpans:
    """The spans of one request; ``stage`` records a child span from the previous mark to now."""

    __slots__ = ("_endpoint", "_start", "_mark", "_rec", "recording")

    def __init__(self, export: TraceExport, headers: Any, endpoint: str) -> None:
        self._endpoint = endpoint
        self._start = self._mark = time.time_ns()
        self._rec = otel.Recording(export, headers, otel.operation(endpoint))
        self.recording = self._rec.sampled

    @property
    def trace_id(self) -> int:
        return self._rec.trace_id

    def stage(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        if not self.recording:
            return
        now = time.time_ns()
        self._rec.child(name, self._mark, now, attributes)
        self._mark = now

    def attempt(self, number: int, pool: str, proposer: str, draft_tokens: int, worker: str, rid: str
                ) -> tuple[Attempt | None, dict[str, str]]:
        """A dispatch attempt's span (None when not sampled), and the headers that make the worker's span its
        child."""
        if not self.recording:
            return None, self._rec.traceparent()
        span = self._rec.child("dispatch", time.time_ns(), 0, {
            "specgate.attempt": number, "specgate.pool": pool, "specgate.proposer": proposer,
            "specgate.draft_tokens": draft_tokens, "server.address": worker, "specgate.worker_rid": rid}, CLIENT)
        return Attempt(span), self._rec.traceparent(span.span_id)

    def dispatched(self) -> None:
        """The answer starts now (the relay span starts here)."""
        self._mark = time.time_ns()

    def finish(self, f: Finished, record: RequestRecord) -> None:
        """Record the relay span (when a worker answered) and the request span, with its attributes, and ship the
        request's spans to the exporter process."""
        if not self.recording:
            return
        now = time.time_ns()  # the request's end: the relay's and the request span's
        if f.dispatched is not None:
            self._rec.child("relay", self._mark, now, {"specgate.stream": f.stream})
        op = otel.operation(self._endpoint)
        model = f.admitted.features.model if f.admitted is not None else ""
        d = f.decision
        body = f.admitted.body if f.admitted is not None else {}
        r = record
        served, decided = f.dispatched is not None, d is not None
        failed = r.status != "ok"
        attributes = [  # in the order of LAYOUTS[GATEWAY_REQUEST] (telemetry/otel_pipe.py); None: not set
            GATEWAY_REQUEST, op, "specgate", model or None,
            body.get("max_completion_tokens", body.get("max_tokens")), body.get("temperature"),
            r.prompt_tokens if served else None, r.completion_tokens if served else None,
            r.http_status, r.request_id, r.status, r.route or None, r.slice or None, r.pool or None, r.rule or None,
            r.reason or None, r.proposer if decided else None, r.draft_tokens if decided else None,
            d.explored if decided else None, r.exploration, r.fallback if decided else None, r.retries,
            r.worker or None, r.verify_ct, r.accept_length, r.num_proposed_drafts, r.num_correct_drafts,
            _ms(r.ttft_s), _ms(r.tpot_s), _ms(r.overhead_s), _ms(r.slo_ttft_s), _ms(r.slo_tpot_s), r.slo_met,
            (r.error_type or r.status) if failed else None]
        error = (r.error_message or r.status) if failed else None
        self._rec.ship(f"{op} {model}" if model else op, SERVER, self._start, now, attributes, error)


def _ms(seconds: float | None) -> float | None:
    return seconds * 1e3 if seconds is not None else None
