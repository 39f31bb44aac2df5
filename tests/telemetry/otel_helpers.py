"""Test helpers: a ``TraceExport`` whose pipe keeps what it is shipped, read back as the SDK's spans
(:func:`readable_spans`); tests/telemetry/test_otlp_encode.py checks that the exporter process sends what the SDK's
own encoder makes of these. The pipe itself, with a real exporter process, is tested in
tests/integration/test_otel_pipe.py."""

from __future__ import annotations

from typing import Any

import msgspec
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from telemetry.otel import TraceExport
from telemetry.otel_export import SCOPE
from telemetry.otel_gateway import GatewayTrace, spans_of
from telemetry.otel_pipe import SAMPLED, WireTrace, attribute_items

_KINDS = {k.value: k for k in SpanKind}


def readable_spans(trace: WireTrace, resource: Resource) -> list[ReadableSpan]:
    """The SDK's spans for one request's record: the root's parent is the client's span (remote) or none, every
    other span's is the one it names; all carry the trace's ``tracestate``."""
    trace_id = (trace.trace_hi << 64) | trace.trace_lo
    state = TraceState.from_header([trace.trace_state]) if trace.trace_state else TraceState()
    flags = TraceFlags(SAMPLED)
    remote = (SpanContext(trace_id, trace.remote_parent, is_remote=True,
                          trace_flags=TraceFlags(trace.remote_flags), trace_state=state)
              if trace.remote_parent else None)
    out = []
    for s in trace.spans:
        parent = remote if s.parent_id == 0 else SpanContext(trace_id, s.parent_id, is_remote=False,
                                                              trace_flags=flags, trace_state=state)
        out.append(ReadableSpan(
            s.name, context=SpanContext(trace_id, s.span_id, is_remote=False, trace_flags=flags, trace_state=state),
            parent=parent, resource=resource, attributes=dict(attribute_items(s.attributes)), kind=_KINDS[s.kind],
            status=Status() if s.error is None else Status(StatusCode.ERROR, s.error),
            start_time=s.start_ns, end_time=s.end_ns, instrumentation_scope=InstrumentationScope(SCOPE)))
    return out


class Shipped(list):
    """The traces shipped, each through a msgpack round trip (what the exporter process decodes); ``frames``: the
    bytes that crossed the pipe."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[bytes] = []

    def ship(self, trace: WireTrace | GatewayTrace) -> None:
        """As the exporter process reads it: the gateway's trace as its spans (telemetry/otel_gateway.py)."""
        self.frames.append(msgspec.msgpack.encode(trace))
        trace = msgspec.msgpack.decode(self.frames[-1], type=WireTrace | GatewayTrace)
        self.append(spans_of(trace) if isinstance(trace, GatewayTrace) else trace)

    def spans(self) -> list:
        resource = Resource.create({"service.name": "test"})
        return [span for trace in self for span in readable_spans(trace, resource)]


def shipping(sampler: Any) -> tuple[TraceExport, Shipped]:
    shipped = Shipped()
    return TraceExport("test", sampler, shipped), shipped
