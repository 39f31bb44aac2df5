"""The gateway's OpenTelemetry spans (gateway/request_spans.py) on a real ``dispatch`` with a retry: one ``dispatch``
span per attempt, the failed one ERROR with its error type, each attempt's ``traceparent`` naming its own span,
and an unsampled request building no child span. Spans go to the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode

from backends.sglang.errors import WorkerConnectError
from gateway.dispatch import dispatch
from gateway.holds import Stopwatch
from gateway.request_spans import RequestSpans
from gateway.stages import Admitted, Arrival
from policies.decide import decide
from policies.features import RequestFeatures
from policies.load import load_policy
from policies.snapshot import PoolState, Snapshot, SnapshotData
from tests.gateway.gateway_helpers import offline_backend
from telemetry.otel import Tracing, handed_ids

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


def _tracing(sampler) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    ids = handed_ids()
    provider = TracerProvider(sampler=sampler, id_generator=ids)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, provider.get_tracer("test"), "test", ids), exporter


def _dispatch_with_a_retry(spans: RequestSpans) -> list[tuple[str, dict[str, str]]]:
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
    served, _ = asyncio.run(dispatch(state, admitted, decision, holds, Stopwatch(), send, spans))
    assert (served.pool, served.retries) == ("plain", 1)
    return sent


def test_each_attempt_is_a_dispatch_span_and_the_worker_gets_its_traceparent():
    tracing, exporter = _tracing(ALWAYS_ON)
    spans = RequestSpans(tracing, CLIENT, "chat")
    spans.stage("admit")
    sent = _dispatch_with_a_retry(spans)
    spans.root.end()
    finished = exporter.get_finished_spans()
    attempts = [s for s in finished if s.name == "dispatch"]
    assert [(s.attributes["specgate.attempt"], s.attributes["specgate.pool"], s.attributes["server.address"],
             s.attributes["specgate.worker_rid"], s.status.status_code, s.attributes.get("error.type"), s.kind)
            for s in attempts] == [
        (1, "ngram", "http://ngram:1", "r-1", StatusCode.ERROR, "WorkerConnectError", SpanKind.CLIENT),
        (2, "plain", "http://plain:1", "r-2", StatusCode.UNSET, None, SpanKind.CLIENT)]
    root = next(s for s in finished if s.name == "text_completion" or s.name == "chat")
    assert root.parent.span_id == 0x00f067aa0ba902b7 and root.context.trace_id == 0x4bf92f3577b34da6a3ce929d0e0e4736
    assert all(s.parent.span_id == root.context.span_id for s in attempts)
    # each attempt's traceparent names its own span: the worker's span becomes that attempt's child
    assert [headers["traceparent"] for _, headers in sent] == [
        f"00-{root.context.trace_id:032x}-{s.context.span_id:016x}-01" for s in attempts]


def test_an_unsampled_request_builds_no_span_at_all_but_still_tells_the_worker():
    tracing, exporter = _tracing(ALWAYS_OFF)
    spans = RequestSpans(tracing, {}, "chat")
    assert (spans.recording, spans.root) == (False, None)  # decided before any span object was built
    spans.stage("admit")
    sent = _dispatch_with_a_retry(spans)
    assert exporter.get_finished_spans() == ()
    parents = {headers["traceparent"] for _, headers in sent}
    [parent] = parents  # the root's context, for every attempt
    # trace flags: sampled bit (0x01) clear, so the worker's parent-based sampler records nothing either; 0x02
    # is W3C level 2's "random trace id" bit, which this SDK sets
    assert parent.split("-")[3] == "02"
    version, trace_id, span_id, _ = parent.split("-")
    assert (version, len(trace_id), len(span_id), int(trace_id, 16) > 0, int(span_id, 16) > 0) == ("00", 32, 16, True,
                                                                                                      True)


def test_a_client_that_says_not_sampled_gets_its_trace_continued_unsampled():
    tracing, exporter = _tracing(ParentBased(ALWAYS_ON))
    client = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"}
    spans = RequestSpans(tracing, client, "chat")
    assert spans.recording is False and spans.root is not None  # the SDK follows the client's flag
    _, headers = spans.attempt(1, "ngram", "ngram", 4, "http://ngram:1", "r-1")
    assert headers["traceparent"].startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    assert headers["traceparent"].endswith("-00") and exporter.get_finished_spans() == ()


def test_a_ratio_sampler_decides_once_per_request_on_the_trace_id_it_exports():
    # the request path decides before any span exists; the SDK decides again on the same id and must agree, or
    # the sampled share would be the ratio squared
    tracing, exporter = _tracing(ParentBased(TraceIdRatioBased(0.5)))
    random.seed(55)  # trace ids come from the random module, as the SDK's own do
    built = [RequestSpans(tracing, {}, "chat") for _ in range(400)]
    for spans in built:
        if spans.root is not None:
            spans.root.end()
    sampled = [s for s in built if s.recording]
    assert all(s.root is not None for s in sampled) and all(s.root is None for s in built if not s.recording)
    assert 150 < len(sampled) < 250  # 0.5 of 400 (5 standard deviations); the ratio squared would be ~100
    exported = {span.context.trace_id for span in exporter.get_finished_spans()}
    assert exported == {s.root.context.trace_id for s in sampled} and len(exported) == len(sampled)
    assert all(tid & ((1 << 64) - 1) < TraceIdRatioBased.get_bound_for_rate(0.5) for tid in exported)
