"""The gateway's OpenTelemetry spans (gateway/request_spans.py) on a real ``dispatch`` with a retry: one ``dispatch``
span per attempt, the failed one ERROR with its error type, each attempt's ``traceparent`` naming its own span,
and an unsampled request recording nothing. The recorded ``WireTrace`` is read back as the SDK's spans
(tests/telemetry/otel_helpers.readable_spans), whose OTLP encoding is what the exporter process sends
(tests/telemetry/test_otlp_encode.py)."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from typing import Any

import msgspec
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode

from backends.sglang.errors import WorkerConnectError
from bench.otel_spans import served_request
from gateway.dispatch import dispatch
from gateway.holds import Stopwatch
from gateway.request_spans import RequestSpans, begin
from gateway.stages import Admitted, Arrival
from policies.decide import decide
from policies.features import RequestFeatures
from policies.load import load_policy
from policies.snapshot import PoolState, Snapshot, SnapshotData
from tests.gateway.gateway_helpers import offline_backend
from tests.telemetry.otel_helpers import shipping

POLICY = """
version: 1
slices: [{name: prose}]
pairs: {ng: {target: {model: m}, draft: {kind: ngram}}}
pools:
  plain: {proposer: none, workers: ["http://plain:1"], speculation: per_request}
  ngram: {proposer: ngram, draft_tokens: 4, pair: ng, workers: ["http://ngram:1"], speculation: per_request}
rules: [{name: ngram, then: {pool: ngram, draft_tokens: 4}}]
"""
CLIENT = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


def _finish(spans: RequestSpans) -> None:
    spans.dispatched()  # as gateway/lifecycle.py does once a worker answered
    spans.finish(*served_request())


def _dispatch_with_a_retry(spans: RequestSpans | None, unsampled: dict[str, str] | None = None
                           ) -> list[tuple[str, dict[str, str]]]:
    """The ngram worker refuses the connection; the plain fallback serves. (worker, headers) of each attempt."""
    policy = load_policy(POLICY, "p.yaml")
    decision = decide(policy, RequestFeatures(), Snapshot(SnapshotData(
        pools={p: PoolState(healthy=True, pair_verified=True) for p in policy.pools})))
    state = SimpleNamespace(backend=offline_backend(policy),
                            settings=SimpleNamespace(max_attempts=3, abort_timeout_s=1.0),
                            spawn=lambda coro: coro.close())
    admitted = Admitted(arrival=Arrival(request_id="r", endpoint="chat", t0=0.0),
                        active=SimpleNamespace(policy=policy), route="default", body={"model": "m"},
                        features=RequestFeatures(), stream=False, include_usage=False, echo=False, cost_tokens=0)
    sent: list[tuple[str, dict[str, str]]] = []

    async def send(url: str, fwd: dict[str, Any], headers: dict[str, str]) -> str:
        sent.append((url, headers))
        if url == "http://ngram:1":
            raise WorkerConnectError(url, "refused")
        return "ok"

    holds = SimpleNamespace(hold_worker=lambda backend, pool, url: None)
    served, _ = asyncio.run(dispatch(state, admitted, decision, holds, Stopwatch(), send, spans, unsampled))
    assert (served.pool, served.retries) == ("plain", 1)
    return sent


def test_each_attempt_is_a_dispatch_span_and_the_worker_gets_its_traceparent():
    tracing, shipped = shipping(ALWAYS_ON)
    spans, unsampled = begin(tracing, {**CLIENT, "tracestate": "vendor=1"}, "chat")
    assert spans is not None and unsampled is None
    spans.admitted()
    sent = _dispatch_with_a_retry(spans)
    assert shipped == []  # nothing leaves before the request ends
    _finish(spans)
    [trace] = shipped
    finished = shipped.spans()
    assert [s.name for s in finished] == ["admit", "dispatch", "dispatch", "relay", "chat m"]
    attempts = [s for s in finished if s.name == "dispatch"]
    assert [(s.attributes["specgate.attempt"], s.attributes["specgate.pool"], s.attributes["server.address"],
             s.attributes["specgate.worker_rid"], s.status.status_code, s.attributes.get("error.type"), s.kind)
            for s in attempts] == [
        (1, "ngram", "http://ngram:1", "r-1", StatusCode.ERROR, "WorkerConnectError", SpanKind.CLIENT),
        (2, "plain", "http://plain:1", "r-2", StatusCode.UNSET, None, SpanKind.CLIENT)]
    assert attempts[0].status.description == "http://ngram:1: refused"
    root = finished[-1]
    assert (root.kind, root.attributes["gen_ai.operation.name"], root.attributes["specgate.pool"]) == \
        (SpanKind.SERVER, "chat", "hybrid")
    assert root.parent.span_id == 0x00f067aa0ba902b7 and root.parent.is_remote
    assert root.context.trace_id == 0x4bf92f3577b34da6a3ce929d0e0e4736 == spans.trace_id
    assert all(s.parent.span_id == root.context.span_id and not s.parent.is_remote for s in finished[:-1])
    assert all(s.context.trace_state.get("vendor") == "1" for s in finished)  # the client's tracestate, kept
    # every span inside the request's; each stage starts where the previous one ended
    assert all(root.start_time <= s.start_time <= s.end_time <= root.end_time for s in finished)
    admit, relay = finished[0], finished[3]
    assert admit.start_time == root.start_time and relay.end_time == root.end_time
    # each attempt's traceparent names its own span: the worker's span becomes that attempt's child
    assert [headers["traceparent"] for _, headers in sent] == [
        f"00-{root.context.trace_id:032x}-{s.context.span_id:016x}-01" for s in attempts]
    assert {headers["tracestate"] for _, headers in sent} == {"vendor=1"}
    assert (trace.remote_parent, trace.remote_flags) == (0x00f067aa0ba902b7, 1)


def test_an_unsampled_request_records_nothing_but_still_tells_the_worker():
    tracing, shipped = shipping(ALWAYS_OFF)
    spans, unsampled = begin(tracing, {}, "chat")
    assert spans is None and unsampled is not None  # decided before anything was recorded
    sent = _dispatch_with_a_retry(spans, unsampled)
    assert shipped == []
    parents = {headers["traceparent"] for _, headers in sent}
    [parent] = parents  # the same context for every attempt
    # trace flags: sampled bit (0x01) clear, so the worker's parent-based sampler records nothing either; 0x02
    # is W3C level 2's "random trace id" bit, as the SDK sets it on a trace it starts
    assert parent.split("-")[3] == "02"
    version, trace_id, span_id, _ = parent.split("-")
    assert (version, len(trace_id), int(trace_id, 16) > 0, len(span_id), int(span_id, 16) > 0) == (
        "00", 32, True, 16, True)
    assert set(unsampled) == {"traceparent"}  # no tracestate without a caller's


def test_a_client_that_says_not_sampled_gets_its_trace_continued_unsampled():
    tracing, shipped = shipping(ParentBased(ALWAYS_ON))
    client = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"}
    spans, headers = begin(tracing, {**client, "tracestate": "vendor=1"}, "chat")
    assert spans is None and headers is not None  # the SDK's parent-based sampler follows the client's flag
    assert headers["traceparent"].startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    assert headers["traceparent"].endswith("-00") and headers["tracestate"] == "vendor=1" and shipped == []


def test_a_malformed_traceparent_starts_a_new_trace():
    tracing, shipped = shipping(ParentBased(ALWAYS_ON))
    spans, _ = begin(tracing, {"traceparent": "00-nothex-00f067aa0ba902b7-01"}, "chat")
    assert spans is not None
    _finish(spans)
    [trace] = shipped
    assert trace.remote_parent == 0 and spans.trace_id != 0
    assert shipped.spans()[-1].parent is None  # the gateway's span is the trace's root


def test_a_ratio_sampler_decides_once_per_request_on_the_trace_id_it_exports():
    tracing, shipped = shipping(ParentBased(TraceIdRatioBased(0.5)))
    random.seed(55)  # trace ids come from the random module, as the SDK's own do
    built = [begin(tracing, {}, "chat") for _ in range(400)]
    sampled = [spans for spans, _ in built if spans is not None]
    for spans in sampled:
        _finish(spans)
    assert 150 < len(sampled) < 250  # 0.5 of 400 (5 standard deviations)
    exported = {span.context.trace_id for span in shipped.spans()}
    assert exported == {s.trace_id for s in sampled} and len(shipped) == len(sampled)
    # the SDK's ratio rule: sampled exactly when the id's low 64 bits are under the bound; the unsampled send
    # their trace id on
    bound = TraceIdRatioBased.get_bound_for_rate(0.5)
    ids = [(s.trace_id, True) if s is not None else (int(h["traceparent"].split("-")[1], 16), False) for s, h in built]
    assert all((trace_id & ((1 << 64) - 1) < bound) == recorded for trace_id, recorded in ids)


def test_the_debug_flags_texts_never_reach_the_exporter_process():
    """A gateway run with its debug-text flag keeps the prompt and completion in the record it logs; the trace it
    ships to the exporter process carries the record without them, and the request's other values."""
    tracing, shipped = shipping(ALWAYS_ON)
    finished, record = served_request()
    spans, _ = begin(tracing, {}, "chat")
    assert spans is not None
    spans.dispatched()
    spans.finish(finished, msgspec.structs.replace(record, prompt_text="secret prompt", completion_text="secret"))
    [frame] = shipped.frames
    assert b"secret" not in frame
    root = shipped.spans()[-1]
    assert (root.attributes["specgate.request_id"], root.attributes["gen_ai.usage.output_tokens"]) == (
        record.request_id, record.completion_tokens)
