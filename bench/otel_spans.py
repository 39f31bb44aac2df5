"""What the gateway's OpenTelemetry span code costs per request, in one process, without a gateway around it.

    .venv/bin/python -m bench.otel_spans [--requests 20000] [--repeats 3]

One request's hooks as ``gateway/lifecycle.py`` calls them (``RequestSpans``, the admit and decide stages, one
dispatch attempt, the relay, the request span's attributes at the end), with the gateway's sampler:
- **unsampled**: sampler ratio 0, what each request of a gateway sampling a few percent pays;
- **sampled**: ratio 1, the request's trace recorded and msgpack-encoded into the pipe's buffer (``SpanPipe.ship`` with no
  exporter process: the buffer is emptied instead of written): the gateway's whole share;
- **export**: what the exporter process (``telemetry/otel_export.py``) does per request, on another core: decode
  the frame, build its spans (telemetry/otel_gateway.py) and encode them to OTLP protobuf (telemetry/otlp_encode.py),
  512 spans to a request as it sends them (the HTTP send is not timed).
Printed in microseconds per request, each repeat on its own line (the machine's noise shows).
"""

from __future__ import annotations

import argparse
import time
import timeit
from types import SimpleNamespace

import msgspec

from gateway.request_spans import begin
from telemetry.otel import TraceExport
from telemetry.otel_gateway import GatewayTrace, spans_of
from telemetry.otel_pipe import FRAME_HEADER, SpanPipe, WireTrace
from telemetry.otlp_encode import Encoder
from telemetry.record import RequestRecord

BATCH = 512  # OTEL_BSP_MAX_EXPORT_BATCH_SIZE's default


def served_request() -> tuple[SimpleNamespace, RequestRecord]:
    """A served streamed request's ``Finished`` (the fields ``RequestSpans.finish`` reads) and ``RequestRecord``."""
    record = RequestRecord(
        request_id="0" * 32, route="default", slice="code", pool="hybrid", rule="learned", reason="auto",
        proposer="hybrid", draft_tokens=16, stream=True, prompt_tokens=120, completion_tokens=64, retries=0,
        worker="http://127.0.0.1:30000", verify_ct=30, accept_length=2.1, num_proposed_drafts=90,
        num_correct_drafts=33, correct_drafts_histogram=[3] * 17, accepted_per_position=[30] * 16,
        reached_per_position=[33] * 16, ttft_s=0.1, tpot_s=0.01, e2e_s=0.74, overhead_s=2e-4, slo_ttft_s=2.0,
        slo_tpot_s=0.15, slo_met=True, concurrency=4, timestamp=1.7e9)
    finished = SimpleNamespace(dispatched=1, stream=True, decision=SimpleNamespace(explored=False),
                               admitted=SimpleNamespace(features=SimpleNamespace(model="m"), body={"max_tokens": 64}))
    return finished, record


class _Buffered(SpanPipe):
    """The gateway's pipe without an exporter process: frames are encoded into the buffer, which is emptied
    (``keep``: kept, for the exporter's share). A write is always pending, as in a busy gateway, where one
    ``call_later`` serves the ~100 requests of each 20 ms (without an event loop, scheduling one would raise)."""

    def __init__(self, keep: bool = False) -> None:
        super().__init__("bench", max_buffer=1 << 30)
        self.keep = keep
        self._timer = object()  # type: ignore[assignment]  # never fires: flush() empties the buffer instead

    def flush(self) -> None:
        if not self.keep:
            self._discard()


def _tracing(ratio: float, pipe: SpanPipe) -> TraceExport:
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased  # ~0.1 s: this benchmark only

    return TraceExport("bench", ParentBased(TraceIdRatioBased(ratio)), pipe)


def _request(tracing: TraceExport, finished, record) -> None:
    spans, _ = begin(tracing, {}, "chat")
    if spans is None:  # unsampled: its traceparent is all it built
        return
    spans.admitted()
    spans.decided()
    span, _ = spans.attempt(1, "hybrid", "hybrid", 16, "http://127.0.0.1:30000", "r-1")
    span.end()
    spans.dispatched()
    spans.finish(finished, record)


def measure(requests: int) -> dict[str, float]:
    """Microseconds per request: unsampled, sampled (recorded and encoded), export (the exporter process)."""
    from opentelemetry.sdk.resources import Resource  # see _tracing

    from telemetry.otel_export import SCOPE, take_frames  # imports the SDK exporter: see _tracing

    finished, record = served_request()
    out = {}
    for name, ratio in (("unsampled", 0.0), ("sampled", 1.0)):
        tracing = _tracing(ratio, _Buffered())
        out[name] = timeit.timeit(lambda t=tracing: _request(t, finished, record), number=requests) / requests * 1e6
    pipe = _Buffered(keep=True)  # every frame: what the exporter process reads
    tracing = _tracing(1.0, pipe)
    n = min(requests, 4 * BATCH)
    for _ in range(n):
        _request(tracing, finished, record)
    decode = msgspec.msgpack.Decoder(WireTrace | GatewayTrace).decode
    frame_bytes = len(pipe._buf)
    resource = Resource.create({"service.name": "bench"})
    encoder = Encoder(resource.attributes, SCOPE, resource.schema_url)
    t0 = time.perf_counter()
    batch: list = []
    for payload in take_frames(pipe._buf):
        batch += encoder.spans(spans_of(decode(payload)))
        if len(batch) >= BATCH:
            encoder.request(batch)
            batch = []
    if batch:
        encoder.request(batch)
    out["export"] = (time.perf_counter() - t0) / n * 1e6
    out["frame_bytes"] = frame_bytes / n - FRAME_HEADER
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000, help="requests timed per figure")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print("us per request: unsampled | sampled (recorded, encoded: the gateway) | export (the exporter process)"
          " | frame bytes")
    for _ in range(args.repeats):
        r = measure(args.requests)
        print(f"{r['unsampled']:.2f} | {r['sampled']:.1f} | {r['export']:.1f} | {r['frame_bytes']:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
