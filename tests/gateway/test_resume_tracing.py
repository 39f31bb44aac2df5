"""Tracing a stream that resumes (gateway/resume.py with gateway/request_spans.py), through the real app in front of
two SGLang stand-ins (tests/gateway/resume_stand_ins.py) and exporting to an OTLP/HTTP receiver decoding the
official messages: a sampled request's resume is a dispatch span of its own, whose id the continuing worker gets
as its parent; an unsampled one sends the same unsampled ``traceparent`` on every worker call and exports nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.gateway.resume_stand_ins import gateway_in_front
from tests.integration.otlp_receiver import otlp_receiver

BODY = {"model": "llama-3.1-8b", "prompt": "Count:", "max_tokens": 7, "temperature": 0, "stream": True}


def _calls(*servers) -> tuple[Any, Any]:
    """The original completions call (a text prompt) and the continuation (a prompt of token ids)."""
    calls = [x for s in servers for x in s.received if x.path == "/v1/completions"]
    [first] = [x for x in calls if isinstance(x.body["prompt"], str)]
    [resumed] = [x for x in calls if isinstance(x.body["prompt"], list)]
    return first, resumed


@pytest.fixture
def tracing_env(monkeypatch):
    """Trace export to a receiver; yields (set the sampler, receiver)."""
    monkeypatch.setenv("SPECGATE_ADMIN_TOKEN", "adm")
    with otlp_receiver() as (endpoint, receiver):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        yield lambda sampler: monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler), receiver


def test_a_sampled_resume_is_a_dispatch_span_and_the_continuing_worker_its_child(tmp_path, tracing_env):
    sample, receiver = tracing_env
    sample("always_on")
    with gateway_in_front(tmp_path) as (client, a, b):
        r = client.post("/v1/completions", json=BODY)
        last = json.loads([line for line in r.text.splitlines() if line.startswith("data: {")][-1][6:])
        assert last["specgate"]["resumed"]["count"] == 1
        trace = receiver.trace_of_request(last["specgate"]["request_id"])
        spans = receiver.wait_for(trace, {("specgate-gateway", "relay")})
    first, resumed = _calls(a, b)
    dispatches = sorted((s for s in spans if s.name == "dispatch"), key=lambda s: s.attributes["specgate.attempt"])
    assert [(s.attributes["specgate.attempt"], s.attributes["specgate.proposer"],
             s.attributes.get("specgate.resumed_at_token")) for s in dispatches] == [(1, "none", None), (2, "resume", 4)]
    # each worker call names its own attempt's span as its parent, in the request's trace, sampled
    assert [first.headers["traceparent"], resumed.headers["traceparent"]] == [
        f"00-{trace}-{s.span_id}-03" for s in dispatches]
    assert [s.attributes["server.address"] for s in dispatches] == [
        next(w.url for w in (a, b) if call in w.received) for call in (first, resumed)]


def test_an_unsampled_resume_sends_the_same_unsampled_context_and_exports_nothing(tmp_path, tracing_env):
    sample, receiver = tracing_env
    sample("always_off")
    with gateway_in_front(tmp_path) as (client, a, b):
        r = client.post("/v1/completions", json=BODY)
        assert '"resumed": {"count": 1' in r.text or '"resumed":{"count":1' in r.text
    # the app has shut down: its exporter process sent what it held before it exited
    first, resumed = _calls(a, b)
    parent = first.headers["traceparent"]
    assert resumed.headers["traceparent"] == parent
    version, trace_id, span_id, flags = parent.split("-")
    assert (version, len(trace_id), len(span_id), flags) == ("00", 32, 16, "02")  # sampled bit clear
    assert receiver.spans == []
