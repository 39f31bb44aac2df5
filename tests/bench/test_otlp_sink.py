"""bench/otlp_sink.py, the collector stand-in of bench.gateway's tracing arm: its span count, read only down to
the spans, equals a full decode with the official protobuf messages for any batch the exporter process sends
(several resources and scopes included); and the real sink process counts what it was posted."""

from __future__ import annotations

import sys

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.otlp_sink import span_count
from bench.processes import free_port, running
from telemetry.otel_export import SCOPE
from telemetry.otel_pipe import SERVER, WireSpan, WireTrace
from telemetry.otlp_encode import Encoder

ENCODER = Encoder({"service.name": "specgate-gateway"}, SCOPE)


def _batch(spans_per_trace: list[int]) -> bytes:
    spans = [b for n, count in enumerate(spans_per_trace) for b in ENCODER.spans(WireTrace(0, n + 1, 0, 0, "", [
        WireSpan(f"s{i}", i + 1, 0, SERVER, 1, 2, {"specgate.n": n, "pad": "x" * i}) for i in range(count)]))]
    return ENCODER.request(spans)


def _full(body: bytes) -> int:
    request = ExportTraceServiceRequest.FromString(body)
    return sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 6), max_size=8), min_size=1, max_size=3))
def test_the_count_is_a_full_decodes_for_any_batch(batches):
    """One exporter request per inner list, concatenated: protobuf merges them into several resource_spans."""
    body = b"".join(_batch(b) for b in batches)
    assert span_count(body) == _full(body) == sum(map(sum, batches))


def test_the_sink_process_counts_what_it_was_posted(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running([sys.executable, "-m", "bench.otlp_sink", "--port", str(port)], f"{url}/", tmp_path / "sink.log"):
        bodies = [_batch([5, 5, 2]), _batch([1])]
        for body in bodies:
            answer = httpx.post(f"{url}/v1/traces", content=body,
                                headers={"content-type": "application/x-protobuf"})
            assert (answer.status_code, answer.content) == (200, b"")
        assert httpx.post(f"{url}/v1/metrics", content=b"").status_code == 404
        assert httpx.get(f"{url}/").text == f"3 posts, {sum(map(len, bodies))} bytes, 13 spans\n"
