"""What the gateway's OpenTelemetry span code costs per request, in one process, without a gateway around it.

    .venv/bin/python -m bench.otel_spans [--requests 20000] [--repeats 3]

One request's hooks as ``gateway/lifecycle.py`` calls them (``RequestSpans``, the admit and decide stages, one
dispatch attempt, the relay, the request span's attributes at the end), on the SDK the gateway configures:
- **unsampled**: sampler ratio 0, what each request of a gateway sampling a few percent pays;
- **sampled**: ratio 1, the spans built and handed to a processor that keeps nothing;
- **encode**: the OTLP protobuf encoding of those spans (what the batch processor's export thread does per
  request), measured on 512 requests' spans at a time, as the SDK batches them.
Printed in microseconds per request, each repeat on its own line (the machine's noise shows).
"""

from __future__ import annotations

import argparse
import time
import timeit
from types import SimpleNamespace

from gateway.request_spans import RequestSpans
from telemetry import otel

BATCH = 512  # OTEL_BSP_MAX_EXPORT_BATCH_SIZE's default


def _finished() -> tuple[SimpleNamespace, SimpleNamespace]:
    """A served streamed request's ``Finished`` and ``RequestRecord``, with the fields ``finish`` reads."""
    record = SimpleNamespace(
        prompt_tokens=120, completion_tokens=64, http_status=200, request_id="0" * 32, status="ok", route="default",
        slice="code", pool="hybrid", rule="learned", reason="auto", proposer="hybrid", draft_tokens=16,
        exploration=None, fallback=False, retries=0, worker="http://127.0.0.1:30000", verify_ct=30,
        accept_length=2.1, num_proposed_drafts=90, num_correct_drafts=33, ttft_s=0.1, tpot_s=0.01, overhead_s=2e-4,
        slo_ttft_s=2.0, slo_tpot_s=0.15, slo_met=True, error_type=None, error_message=None)
    finished = SimpleNamespace(dispatched=1, stream=True, decision=SimpleNamespace(explored=False),
                               admitted=SimpleNamespace(features=SimpleNamespace(model="m"), body={"max_tokens": 64}))
    return finished, record


def _tracing(ratio: float, keep: list | None) -> otel.Tracing:
    """The gateway's set-up (telemetry/otel.configure) at ``ratio``; ``keep`` collects finished spans instead of
    the batch processor exporting them."""
    from opentelemetry.sdk.trace import TracerProvider  # ~0.1 s: this benchmark only
    from opentelemetry.sdk.trace.export import SpanProcessor  # see above
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased  # see above

    class Keep(SpanProcessor):
        def on_end(self, span) -> None:
            if keep is not None:
                keep.append(span)

    ids = otel.handed_ids()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)), id_generator=ids)
    provider.add_span_processor(Keep())
    return otel.Tracing(provider, provider.get_tracer("specgate"), "bench", ids)


def _request(tracing: otel.Tracing, finished, record) -> None:
    spans = RequestSpans(tracing, {}, "chat")
    spans.stage("admit")
    spans.stage("decide", {"specgate.slice": "code", "specgate.rule": "learned"})
    span, _ = spans.attempt(1, "hybrid", "hybrid", 16, "http://127.0.0.1:30000", "r-1")
    if span is not None:
        span.end()
    spans.dispatched()
    spans.finish(finished, record)


def measure(requests: int) -> dict[str, float]:
    """Microseconds per request: unsampled, sampled (built), encode (OTLP of the sampled spans)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # see _tracing

    finished, record = _finished()
    out = {}
    for name, ratio in (("unsampled", 0.0), ("sampled", 1.0)):
        tracing = _tracing(ratio, None)
        out[name] = timeit.timeit(lambda t=tracing: _request(t, finished, record), number=requests) / requests * 1e6
    kept: list = []
    tracing = _tracing(1.0, kept)
    n = min(requests, 4 * BATCH)
    for _ in range(n):
        _request(tracing, finished, record)
    per_request = len(kept) // n
    t0 = time.perf_counter()
    for i in range(0, len(kept), BATCH * per_request):
        encode_spans(kept[i:i + BATCH * per_request]).SerializeToString()
    out["encode"] = (time.perf_counter() - t0) / n * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000, help="requests timed per figure")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print("us per request: unsampled | sampled (built) | encode (OTLP, the export thread)")
    for _ in range(args.repeats):
        r = measure(args.requests)
        print(f"{r['unsampled']:.2f} | {r['sampled']:.1f} | {r['encode']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
