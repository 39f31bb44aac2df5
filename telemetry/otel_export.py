"""The gateway's exporter process: :class:`telemetry.otel_pipe.WireTrace` frames on stdin, OTLP/HTTP out.

    python -m telemetry.otel_export SERVICE_NAME      # started by the gateway (telemetry/otel_pipe.SpanPipe)

Each frame becomes the SDK's ``ReadableSpan``s (:func:`readable_spans`), handed to the SDK's
``BatchSpanProcessor`` with its ``OTLPSpanExporter``: batching, the queue bound, retries, endpoint, headers and
timeouts are the SDK's, from the same OTEL_* variables the gateway was started with. At the end of stdin (the
gateway closed the pipe, or died) it exports what it holds and exits. Interrupts are ignored: a Ctrl-C or a
SIGTERM sent to the whole process group reaches the gateway too, which closes the pipe when it has written
everything.
"""

from __future__ import annotations

import signal
import sys
from typing import IO, Any

import msgspec
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from telemetry.otel_pipe import FRAME_HEADER, SAMPLED, WireTrace

SCOPE = InstrumentationScope("specgate")
_KINDS = {k.value: k for k in SpanKind}
_OK = Status()


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
            parent=parent, resource=resource, attributes=s.attributes, kind=_KINDS[s.kind],
            status=_OK if s.error is None else Status(StatusCode.ERROR, s.error),
            start_time=s.start_ns, end_time=s.end_ns, instrumentation_scope=SCOPE))
    return out


def frames(stream: IO[bytes]) -> Any:
    """The frames' payloads until the end of ``stream`` (a frame cut short by the gateway's death is dropped)."""
    while len(header := stream.read(FRAME_HEADER)) == FRAME_HEADER:
        payload = stream.read(int.from_bytes(header, "big"))
        if len(payload) < int.from_bytes(header, "big"):
            return
        yield payload


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    resource = Resource.create({"service.name": argv[0]})  # and OTEL_RESOURCE_ATTRIBUTES, as the SDK reads them
    processor = BatchSpanProcessor(OTLPSpanExporter())  # endpoint, headers, OTEL_BSP_*: the environment
    decode = msgspec.msgpack.Decoder(WireTrace).decode
    try:
        for payload in frames(sys.stdin.buffer):
            try:
                spans = readable_spans(decode(payload), resource)
            except (msgspec.DecodeError, ValueError) as exc:  # never from this gateway; never fatal either
                print(f"specgate otel exporter: skipped a frame it cannot read: {exc}", file=sys.stderr)
                continue
            for span in spans:
                processor.on_end(span)
    finally:
        processor.shutdown()  # exports what is queued (bounded by OTEL_BSP_EXPORT_TIMEOUT)


if __name__ == "__main__":
    main()
