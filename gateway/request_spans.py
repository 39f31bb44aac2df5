"""A request's OpenTelemetry spans in the gateway, recorded as plain values and exported by another process
(``telemetry/otel_pipe.py``; conventions: ``telemetry/otel.py``).

Not the replay recording (``gateway/tracing.py``). Built only when trace export is configured
(``GatewayState.otel`` is not None) and the request is sampled; otherwise ``serve`` holds None and pays one
``is None`` test per hook.

    <client's span, from its traceparent>
      └─ "chat MODEL" (SERVER): the request, arrival to its end; gen_ai.* and specgate.* attributes
           ├─ admit      read, auth, parse, features, model and window checks, limits
           ├─ decide     slice and policy decision
           ├─ dispatch   one per worker attempt (CLIENT): worker, pool, attempt number; a failed one has status
           │             ERROR and error.type; the worker's own span is this span's child (traceparent)
           └─ relay      the answer: the stream from its first chunk to its end, or a whole answer's hand-over

The sampler decides when the request arrives (:func:`begin`); an unsampled request builds nothing but the
``traceparent`` that tells its workers so. A sampled one records the stage times and a ``WireSpan`` per dispatch
attempt, and ships them when it ends with its ``RequestRecord`` (the values the answer's ``specgate`` object and
the metrics carry) as one ``GatewayTrace``; the exporter process builds the spans and their attributes from it
(``telemetry/otel_gateway.py``: off the serving core, ~2x faster per request for the gateway).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from telemetry import otel
from telemetry.otel_gateway import GatewayTrace
from telemetry.otel_pipe import CLIENT, GATEWAY_DISPATCH, WireSpan

if TYPE_CHECKING:
    from gateway.stages import Finished
    from telemetry.otel import ClientContext, TraceExport
    from telemetry.record import RequestRecord


class Attempt:
    """A dispatch attempt's span while it runs (``dispatch.py``, ``resume.py``): ``end`` when it answered, ``fail``
    when it did not, ``resumed_at`` for a resume's attempt. Its attributes are in ``LAYOUTS[GATEWAY_DISPATCH]``."""

    __slots__ = ("span",)

    def __init__(self, span: WireSpan) -> None:
        self.span = span

    def resumed_at(self, token: int) -> None:
        self.span.attributes[7] = token  # specgate.resumed_at_token

    def end(self) -> None:
        if self.span.end_ns == 0:
            self.span.end_ns = time.time_ns()

    def fail(self, error_type: str, message: str) -> None:
        self.span.attributes[8] = error_type  # error.type, as the semantic conventions name it
        self.span.error = message
        self.end()


def begin(export: TraceExport, headers: Any, endpoint: str) -> tuple[RequestSpans | None, dict[str, str] | None]:
    """A request's tracing when it arrives: its spans (None: not sampled), or, not sampled, the headers every
    worker call carries instead (``telemetry.otel.arrived``)."""
    operation = otel.operation(endpoint)
    client, trace_id, unsampled = otel.arrived(export, headers, operation)
    return (RequestSpans(export, client, trace_id, operation) if unsampled is None else None), unsampled


class RequestSpans(otel.Recording):
    """The spans of one sampled request, recorded as the stage times, the attempts and, at the end, the request's
    record (``telemetry/otel_gateway.py`` builds the spans from them in the exporter process)."""

    __slots__ = ("_operation", "_start", "_admit", "_decide", "_relay")

    def __init__(self, export: TraceExport, client: ClientContext | None, trace_id: int, operation: str) -> None:
        self._operation = operation  # gen_ai.operation.name
        self._start = time.time_ns()
        self._admit = self._decide = self._relay = 0
        super().__init__(export, client, trace_id)

    def admitted(self) -> None:
        """Admission ended now (the admit span: arrival to here)."""
        self._admit = time.time_ns()

    def decided(self) -> None:
        """The decision was made now (the decide span: admission to here)."""
        self._decide = time.time_ns()

    def attempt(self, number: int, pool: str, proposer: str, draft_tokens: int, worker: str, rid: str
                ) -> tuple[Attempt, dict[str, str]]:
        """A dispatch attempt's span, and the headers that make the worker's span its child."""
        span = WireSpan("dispatch", otel.new_span_id(), self.root_id, CLIENT, time.time_ns(), 0,
                        [GATEWAY_DISPATCH, number, pool, proposer, draft_tokens, worker, rid, None, None])
        self.spans.append(span)
        return Attempt(span), self.traceparent(span.span_id)

    def dispatched(self) -> None:
        """The answer starts now (the relay span starts here)."""
        self._relay = time.time_ns()

    def finish(self, f: Finished, record: RequestRecord) -> None:
        """Ship the request's trace to the exporter process: its times, attempts and record (the record without
        the debug flag's texts, which never leave the gateway)."""
        end = time.time_ns()
        admitted, d = f.admitted, f.decision
        body = admitted.body if admitted is not None else {}
        if record.prompt_text is not None or record.completion_text is not None:
            record = msgspec.structs.replace(record, prompt_text=None, completion_text=None)
        client = self._client
        self._export.pipe.ship(GatewayTrace(
            self.trace_id >> 64, self.trace_id & 0xFFFF_FFFF_FFFF_FFFF, client.span_id if client is not None else 0,
            client.flags if client is not None else 0, self._state, self.root_id, self._start, self._admit,
            self._decide, (self._relay or end) if f.dispatched is not None else 0, end, self.spans, self._operation,
            admitted.features.model if admitted is not None else "",
            body.get("max_completion_tokens", body.get("max_tokens")), body.get("temperature"), d is not None,
            d is not None and d.explored, record))
