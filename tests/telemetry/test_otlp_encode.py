"""The exporter process's OTLP encoder (telemetry/otlp_encode.py) against the SDK's own: for any request record
the gateway or the worker can ship, the bytes it sends parse (official protobuf classes) to the very message the
SDK's encoder makes of the same spans (tests/telemetry/otel_helpers.readable_spans). Its caches of encoded
attributes never change what it writes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource

import telemetry.otlp_encode as otlp_encode
from telemetry.otel_export import SCOPE
from telemetry.otel_pipe import (
    CLIENT, GATEWAY_REQUEST, INTERNAL, LAYOUTS, SERVER, WireSpan, WireTrace, attribute_items)
from telemetry.otlp_encode import Encoder, varint
from tests.telemetry.otel_helpers import readable_spans

RESOURCE = Resource.create({"service.name": "specgate-gateway", "deployment.environment": "test"})
ENCODER = Encoder(RESOURCE.attributes, SCOPE, RESOURCE.schema_url)  # one for every example: its caches carry over

ids = st.integers(1, 2**64 - 1)
scalars = st.one_of(st.text(max_size=12), st.booleans(), st.integers(-2**63, 2**63 - 1),
                    st.floats(allow_nan=False), st.sampled_from(["code", "hybrid", "", "learned"]),
                    st.sampled_from([0, 1, True, False]))
values = st.one_of(scalars, st.lists(st.text(max_size=4), max_size=3), st.lists(st.integers(-5, 2**40), max_size=3),
                   st.lists(st.floats(allow_nan=False), max_size=3), st.lists(st.booleans(), max_size=3))
keys = st.sampled_from(["gen_ai.request.model", "specgate.slice", "specgate.retries", "n", "a", "b"]) | st.text(
    min_size=1, max_size=10)
laid_out = st.sampled_from(sorted(LAYOUTS)).flatmap(  # any layout, its values unset or any value
    lambda layout: st.lists(st.none() | values, min_size=len(LAYOUTS[layout]), max_size=len(LAYOUTS[layout])).map(
        lambda vs: [layout, *vs]))


@st.composite
def traces(draw) -> WireTrace:
    span_ids = draw(st.lists(ids, min_size=1, max_size=5, unique=True))
    spans = [WireSpan(draw(st.text(min_size=1, max_size=10)), span_id,
                      0 if i == 0 else draw(st.sampled_from(span_ids[:i])),
                      draw(st.sampled_from([INTERNAL, SERVER, CLIENT])), draw(st.integers(0, 2**63)),
                      draw(st.integers(0, 2**63)), draw(st.dictionaries(keys, values, max_size=8) | laid_out),
                      draw(st.none() | st.text(max_size=12)))
             for i, span_id in enumerate(span_ids)]
    return WireTrace(draw(st.integers(0, 2**64 - 1)), draw(ids), draw(st.just(0) | ids), draw(st.sampled_from([0, 1])),
                     draw(st.sampled_from(["", "vendor=abc", "a=1,b=2"])), spans)


def _sent(encoder: Encoder, batch: list[WireTrace]) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest.FromString(encoder.request([b for t in batch for b in encoder.spans(t)]))


def _sdk(batch: list[WireTrace]) -> ExportTraceServiceRequest:
    return encode_spans([s for t in batch for s in readable_spans(t, RESOURCE)])


@settings(max_examples=300, deadline=None)
@given(st.lists(traces(), min_size=1, max_size=4))
def test_what_is_sent_is_what_the_sdk_encoder_makes_of_the_same_spans(batch):
    assert _sent(ENCODER, batch) == _sdk(batch)


def test_a_served_request_and_its_edge_values(monkeypatch):
    """Values a oneof keeps though they are proto3 defaults (an empty string, 0, False, 0.0), an error with and
    without a description, a remote parent, a negative int (10-byte varint); and a cache that keeps forgetting
    (``MAX_CACHED`` 2) writes the same."""
    root = WireSpan("chat", 7, 0, SERVER, 10, 20, {"s": "", "i": 0, "b": False, "f": 0.0, "neg": -3, "t": True,
                                                   "one": 1, "l": ["x", ""], "e": []}, None)
    child = WireSpan("dispatch", 8, 7, CLIENT, 11, 19, {"specgate.retries": 1}, "upstream_error")
    failed = WireSpan("relay", 9, 7, INTERNAL, 12, 18, {}, "")
    batch = [WireTrace(1, 2, 99, 1, "vendor=abc", [root, child, failed]), WireTrace(0, 3, 0, 0, "", [root])]
    assert _sent(Encoder(RESOURCE.attributes, SCOPE), batch) == _sdk(batch)
    monkeypatch.setattr(otlp_encode, "MAX_CACHED", 2)
    forgetful = Encoder(RESOURCE.attributes, SCOPE)
    for _ in range(3):
        assert _sent(forgetful, batch) == _sdk(batch)
    assert forgetful._cached <= 2 and len(forgetful._keys) <= 2 and len(forgetful._names) <= 2


def test_true_and_1_are_different_values_to_the_cache():
    """True == 1 and hash alike in Python; a cache keyed on the value alone would send one for the other."""
    encoder = Encoder({}, SCOPE)
    for value, field in ((True, "bool_value"), (1, "int_value"), (False, "bool_value"), (0, "int_value")):
        trace = WireTrace(0, 1, 0, 0, "", [WireSpan("s", 1, 0, INTERNAL, 0, 1, {"k": value})])
        sent = _sent(encoder, [trace]).resource_spans[0].scope_spans[0].spans[0].attributes[0].value
        assert sent.WhichOneof("value") == field and getattr(sent, field) == value


@pytest.mark.parametrize(("n", "wire"), [(0, b"\x00"), (127, b"\x7f"), (128, b"\x80\x01"), (300, b"\xac\x02"),
                                         (-1, b"\xff" * 9 + b"\x01")])
def test_varints_as_protobuf_writes_them(n, wire):
    assert varint(n) == wire


def test_a_value_otlp_cannot_carry_is_refused_by_name():
    trace = WireTrace(0, 1, 0, 0, "", [WireSpan("s", 1, 0, INTERNAL, 0, 1, {"k": {"nested": 1}})])
    with pytest.raises(TypeError, match="cannot be a dict"):
        ENCODER.spans(trace)


def test_a_laid_out_span_names_its_values_by_the_layout_and_leaves_out_the_unset():
    values = [None] * len(LAYOUTS[GATEWAY_REQUEST])
    values[0], values[8], values[-1] = "chat", "r-1", "upstream_error"
    assert dict(attribute_items([GATEWAY_REQUEST, *values])) == {
        "gen_ai.operation.name": "chat", "specgate.request_id": "r-1", "error.type": "upstream_error"}
    with pytest.raises(ValueError):  # one value short: a layout and its writer out of step fail, never shift
        list(attribute_items([GATEWAY_REQUEST, *values[1:]]))
