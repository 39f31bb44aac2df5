"""OpenTelemetry traces end to end (telemetry/otel.py, gateway/request_spans.py, backends/worker/otel_spans.py): a
real gateway and a real worker export OTLP/HTTP to a receiver started here, which decodes the official protobuf
messages. A client's traceparent continues through the gateway into the worker; the spans carry the values the
answer's ``specgate`` object reports; with the SDK disabled nothing is exported."""

from __future__ import annotations

import httpx
import pytest

from bench.processes import MODEL, gateway, worker, write_policy
from tests.integration.gateway_processes import CODE, policy_text
from tests.integration.otlp_receiver import otlp_receiver

pytestmark = [pytest.mark.integration, pytest.mark.real_model]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind


def _env(endpoint: str, **extra: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100", **extra}


@pytest.fixture(scope="module")
def traced(tmp_path_factory, prepared_model):
    """(gateway URL, receiver): both processes export to the receiver."""
    tmp = tmp_path_factory.mktemp("otel")
    with otlp_receiver() as (endpoint, receiver), \
            worker(tmp, "--max-running-requests", "2", "--num-threads", "1", env=_env(endpoint)) as worker_url:
        policy = write_policy(tmp / "policy.yaml", policy_text([worker_url], revision=prepared_model.revision))
        with gateway(tmp, policy, env=_env(endpoint)) as url:
            yield url, receiver


def _by_name(spans, service: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in spans:
        if s.service == service:
            out.setdefault(s.name, []).append(s)
    return out


def test_a_client_traceparent_continues_through_gateway_and_worker(traced):
    url, receiver = traced
    answer = httpx.post(f"{url}/v1/chat/completions", timeout=120, headers={
        "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "tracestate": "vendor=1",
        "x-slo-ttft-ms": "600000", "x-slo-tpot-ms": "600000"},
        json={"model": MODEL, "messages": [{"role": "user", "content": CODE}], "max_tokens": 12})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    info, usage = body["specgate"], body["usage"]
    root_name = f"chat {MODEL}"
    spans = receiver.wait_for(TRACE_ID, {("specgate-gateway", root_name), ("specgate-gateway", "relay"),
                                         ("specgate-worker", root_name), ("specgate-worker", "decode")})
    gw, wk = _by_name(spans, "specgate-gateway"), _by_name(spans, "specgate-worker")
    assert sorted(gw) == sorted([root_name, "admit", "decide", "dispatch", "relay"])
    assert sorted(wk) == sorted([root_name, "queue", "prefill", "decode"])
    [root] = gw[root_name]
    # the chain: client -> gateway request -> dispatch (one attempt: no retry) -> worker request -> its phases
    assert (root.parent_span_id, root.kind) == (CLIENT_SPAN, SERVER)
    assert {s.parent_span_id for name in ("admit", "decide", "dispatch", "relay") for s in gw[name]} == {root.span_id}
    [dispatch] = gw["dispatch"]
    assert dispatch.kind == CLIENT
    [work] = wk[root_name]
    assert (work.parent_span_id, work.kind) == (dispatch.span_id, SERVER)
    assert {s.parent_span_id for name in ("queue", "prefill", "decode") for s in wk[name]} == {work.span_id}
    # the request span says what the specgate object says
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == \
        (usage["prompt_tokens"], usage["completion_tokens"])
    assert {k: a[f"specgate.{k}"] for k in ("request_id", "route", "slice", "pool", "rule", "reason", "proposer",
                                            "draft_tokens", "retries", "explored", "fallback", "verify_rounds",
                                            "accept_length")} == \
        {k: info[k] for k in ("request_id", "route", "slice", "pool", "rule", "reason", "proposer", "draft_tokens",
                              "retries", "explored", "fallback")} | \
        {"verify_rounds": info["verify_rounds"], "accept_length": info["accept_length"]}
    assert (info["rule"], info["pool"], info["retries"]) == ("code-ngram", "ngram", 0)
    # the request's own SLO (its headers), met by any answer under ten minutes
    assert (a["specgate.slo.ttft_ms"], a["specgate.slo.tpot_ms"], a["specgate.slo_met"]) == (600000.0, 600000.0, True)
    assert (dispatch.attributes["specgate.attempt"], dispatch.attributes["specgate.pool"]) == (1, "ngram")
    assert dispatch.attributes["specgate.worker_rid"] == f"{info['request_id']}-1"
    # the worker's span: what it generated, and its rounds as counters (the gateway relayed the same counts)
    w = work.attributes
    assert (w["specgate.worker_rid"], w["specgate.proposer"]) == (f"{info['request_id']}-1", "ngram")
    assert (w["gen_ai.usage.input_tokens"], w["gen_ai.usage.output_tokens"]) == \
        (usage["prompt_tokens"], usage["completion_tokens"])
    [decode] = wk["decode"]
    assert decode.attributes["specgate.rounds"] == w["specgate.rounds"] == info["verify_rounds"]
    assert decode.attributes["specgate.draft_tokens_accepted"] == a["specgate.draft_tokens_accepted"]
    assert decode.attributes["specgate.draft_tokens_proposed"] == a["specgate.draft_tokens_proposed"]
    [prefill] = wk["prefill"]
    assert prefill.attributes["specgate.prefill_chunks"] == 1  # a short prompt: one chunk
    assert all(s.status_code != 2 for s in spans)


def test_a_stream_without_traceparent_starts_its_own_trace(traced):
    url, receiver = traced
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
            "stream": True}) as answer:
        assert answer.status_code == 200
        request_id = answer.headers["x-specgate-request-id"]
        lines = [line for line in answer.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    trace_id = receiver.trace_of_request(request_id)
    spans = receiver.wait_for(trace_id, {("specgate-gateway", "relay"), ("specgate-worker", f"chat {MODEL}")})
    [root] = [s for s in spans if s.attributes.get("specgate.request_id") == request_id]
    assert root.parent_span_id == ""  # no client context: the gateway's span is the trace's root
    [relay] = [s for s in spans if s.name == "relay"]
    assert relay.attributes["specgate.stream"] is True
    [dispatch] = [s for s in spans if s.name == "dispatch"]
    [work] = [s for s in spans if s.service == "specgate-worker" and s.name == f"chat {MODEL}"]
    assert work.parent_span_id == dispatch.span_id and dispatch.parent_span_id == root.span_id


def test_with_the_sdk_disabled_nothing_is_exported(tmp_path, prepared_model):
    with otlp_receiver() as (endpoint, receiver):
        off = _env(endpoint, OTEL_SDK_DISABLED="true")
        with worker(tmp_path, "--max-running-requests", "1", "--num-threads", "1", env=off) as worker_url:
            policy = write_policy(tmp_path / "policy.yaml", policy_text([worker_url], revision=prepared_model.revision))
            with gateway(tmp_path, policy, env=off) as url:
                answer = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                                    headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
                                    json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                          "max_tokens": 4})
                assert answer.status_code == 200
        # both processes have stopped (a provider flushes at shutdown): anything queued would have been sent
        assert (receiver.posts, receiver.spans) == (0, [])
