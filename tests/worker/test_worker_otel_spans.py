"""The worker's OpenTelemetry span (backends/worker/otel_spans.py), recorded as the exporter process will send it:
a finished request's span under the caller's dispatch span with its queue, prefill and decode phases at the
engine's own times and its counters; an abort, a refusal and a caller that leaves each end the span as an
error; an unsampled request records nothing."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased
from opentelemetry.trace import SpanKind, StatusCode

from backends.engine.types import (
    FinishReason,
    GenerateRequest,
    RequestOutput,
    RequestStats,
    SamplingParams,
    SpeculationParams,
)
from backends.worker.otel_spans import WorkerSpan
from tests.telemetry.otel_helpers import shipping

DISPATCH = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
REQ = GenerateRequest(rid="r-1", input_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=8, temperature=0.0),
                      speculation=SpeculationParams(proposer="ngram", draft_tokens=4))


def _out(reason: FinishReason) -> RequestOutput:
    stats = RequestStats(prompt_tokens=3, completion_tokens=4, verify_ct=2, num_proposed_drafts=8,
                         num_correct_drafts=2, queue_s=0.5, prefill_chunks=1, first_token_s=1.0, e2e_s=2.0)
    return RequestOutput(rid="r-1", new_token_ids=(), output_ids=(5, 6, 7, 8), text="", finished=True,
                         finish_reason=reason, stats=stats)


def test_a_finished_request_continues_the_callers_trace_with_its_phases():
    export, shipped = shipping(ParentBased(ALWAYS_ON))
    span = WorkerSpan(export, DISPATCH, "chat", "m", REQ)
    span.finish(_out(FinishReason(type="length", length=8)))
    queue, prefill, decode, root = shipped.spans()
    assert [s.name for s in (queue, prefill, decode, root)] == ["queue", "prefill", "decode", "chat m"]
    assert (root.kind, root.parent.span_id, root.parent.is_remote) == (SpanKind.SERVER, 0x00f067aa0ba902b7, True)
    assert root.context.trace_id == 0x4bf92f3577b34da6a3ce929d0e0e4736
    assert {s.parent.span_id for s in (queue, prefill, decode)} == {root.context.span_id}
    t0 = root.start_time  # the engine's times count from the submit
    assert [(s.start_time - t0, s.end_time - t0) for s in (queue, prefill, decode, root)] == [
        (0, 500_000_000), (500_000_000, 1_000_000_000), (1_000_000_000, 2_000_000_000), (0, 2_000_000_000)]
    a = root.attributes
    assert (a["specgate.worker_rid"], a["specgate.proposer"], a["specgate.draft_tokens"], a["specgate.rounds"]) == \
        ("r-1", "ngram", 4, 2)
    assert (a["gen_ai.usage.output_tokens"], a["gen_ai.response.finish_reasons"]) == (4, ["length"])  # a list
    assert decode.attributes["specgate.draft_tokens_accepted"] == 2 and root.status.status_code == StatusCode.UNSET


@pytest.mark.parametrize(("end", "error_type", "message"), [
    (lambda s: s.finish(_out(FinishReason(type="abort", message="deadline"))), "abort", "deadline"),
    (lambda s: s.refused(ValueError("queue full")), "ValueError", "queue full"),
    (lambda s: s.abandon(), "ClientDisconnected", "the caller left before the end"),
])
def test_an_unfinished_request_ends_its_span_as_an_error(end, error_type, message):
    export, shipped = shipping(ParentBased(ALWAYS_ON))
    end(WorkerSpan(export, DISPATCH, "chat", "m", REQ))
    root = shipped.spans()[-1]
    assert (root.name, root.attributes["error.type"]) == ("chat m", error_type)
    assert (root.status.status_code, root.status.description) == (StatusCode.ERROR, message)


def test_an_unsampled_request_records_nothing():
    export, shipped = shipping(ParentBased(ALWAYS_OFF))
    span = WorkerSpan(export, {}, "chat", "m", REQ)
    span.finish(_out(FinishReason(type="length", length=8)))
    span.abandon()
    assert (span.recording, shipped) == (False, [])


def test_spans_the_worker_drops_are_counted_in_its_metrics(prepared_model, monkeypatch):
    """With no exporter process to take them (never started here), a sampled request's spans are dropped, and
    the worker's ``specgate_otel_dropped_traces_total`` says so."""
    from prometheus_client import generate_latest

    from backends.worker.runtime import WorkerRuntime
    from backends.worker.settings import WorkerSettings

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    runtime = WorkerRuntime(WorkerSettings())
    span = WorkerSpan(runtime.otel, {}, "chat", "m", REQ)
    span.finish(_out(FinishReason(type="length", length=8)))
    runtime.otel.pipe.flush()
    text = generate_latest(runtime.metrics.registry).decode()
    assert 'specgate_otel_dropped_traces_total{reason="exporter_gone"} 1.0' in text.splitlines()
