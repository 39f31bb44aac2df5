"""OTLP/protobuf bytes for :class:`~telemetry.otel_pipe.WireTrace` spans, written directly: the exporter
process's encoder (telemetry/otel_export.py).

Why not the SDK's: its span objects and its encoder, which builds a protobuf message object per span, attribute
and value in Python, cost the exporter 134-147 us per request of 5 spans and ~39 attributes, and at 100% sampling
that CPU comes from the cores the gateway serves on. This writes the same messages (``ExportTraceServiceRequest``
of opentelemetry-proto, the fields the SDK's encoder sets, with the same values) as bytes: ~19 us per request
with the frame's decoding (``python -m bench.otel_spans``: docs/runs/2026-12-07-otlp-encoder, 24-31 us, and
docs/runs/2026-12-07-otel-request-path, after attributes were written inline).
``tests/telemetry/test_otlp_encode.py`` parses its output with the official protobuf classes and checks it equals
what the SDK's encoder makes of the same spans, so the two cannot drift apart unnoticed.

Proto3 wire format: a field is (number << 3 | wire type) as a varint, then a varint, 8 or 4 little-endian bytes,
or a length-prefixed payload. Fields at their default are left out, except a value of an ``AnyValue`` (a oneof
keeps its presence, so an empty string or a 0 is written) and a span's ``status`` (a message the SDK always
sets, so an unset status is an empty one).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

from telemetry.otel_pipe import Value, WireSpan, WireTrace, attribute_items

_DOUBLE = struct.Struct("<d").pack
_FIXED64 = struct.Struct("<Q").pack
_FIXED32 = struct.Struct("<I").pack

# span flags (trace.proto SpanFlags): the parent's is-remote bit is known, and set when the parent is remote
HAS_IS_REMOTE, IS_REMOTE = 0x100, 0x200
STATUS_ERROR = 2  # opentelemetry.trace.StatusCode.ERROR
MAX_CACHED = 4096  # encoded (key, value) attributes remembered; strings repeat (slice, pool, rule, model)


def varint(n: int) -> bytes:
    """An unsigned varint; a negative int64 as its 64-bit two's complement (10 bytes), as protobuf writes it."""
    if n < 0:
        n += 1 << 64
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_BYTE = [bytes((i,)) for i in range(0x80)]  # a varint under 0x80 is its one byte


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    n = len(payload)
    return tag + (_BYTE[n] if n < 0x80 else varint(n)) + payload


def any_value(value: object) -> bytes:
    """An ``AnyValue``'s payload (common.proto): string 1, bool 2, int 3, double 4, array 5, bytes 7. Booleans
    before ints (a bool is an int in Python), as the SDK's encoder orders them."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return field(b"\x0a", value.encode())
    if isinstance(value, int):
        return b"\x18" + varint(value)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return field(b"\x3a", value)
    if isinstance(value, (list, tuple)):
        return field(b"\x2a", b"".join(field(b"\x0a", any_value(v)) for v in value))
    raise TypeError(f"an OTLP attribute value cannot be a {type(value).__name__}")


class Encoder:
    """Spans to OTLP bytes for one service: ``resource_attributes`` (the SDK's ``Resource.attributes``, which the
    exporter takes from ``Resource.create``) and the ``scope`` name, as the SDK's encoder writes them."""

    def __init__(self, resource_attributes: Mapping[str, object], scope: str, resource_schema_url: str = "") -> None:
        self._cache: dict[tuple[str, type, object], bytes] = {}
        self._keys: dict[str, bytes] = {}  # a key's encoded KeyValue.key field (keys are the code's own)
        self._head = field(b"\x0a", self._resource(resource_attributes))  # ResourceSpans.resource
        self._tail = field(b"\x1a", resource_schema_url.encode()) if resource_schema_url else b""
        self._scope = field(b"\x0a", field(b"\x0a", scope.encode()))  # ScopeSpans.scope: its name

    @staticmethod
    def _resource(attributes: Mapping[str, object]) -> bytes:
        """A resource's ``KeyValue`` fields (field 1), encoded once per process, not cached."""
        return b"".join(field(b"\x0a", field(b"\x0a", k.encode()) + field(b"\x12", any_value(v)))
                        for k, v in attributes.items())

    def _fields(self, attributes: dict[str, Value] | list[Value | None], out: list[bytes]) -> None:
        """Append a span's attributes to ``out`` as ``Span.attributes`` fields (9). A string or bool value's field is
        remembered, and every key's, up to ``MAX_CACHED`` of each (then forgotten all at once); a small int's and a
        float's are written inline. This is the exporter's hot loop, most of its CPU."""
        cache, keys = self._cache, self._keys
        for key, value in attribute_items(attributes):
            kind = type(value)
            if kind is str or kind is bool:
                entry = cache.get((key, kind, value))
                if entry is None:
                    if len(cache) >= MAX_CACHED:
                        cache.clear()
                    entry = cache[key, kind, value] = field(
                        b"\x4a", field(b"\x0a", key.encode()) + field(b"\x12", any_value(value)))
                out.append(entry)
                continue
            name = keys.get(key)
            if name is None:
                if len(keys) >= MAX_CACHED:
                    keys.clear()
                name = keys[key] = field(b"\x0a", key.encode())
            if kind is float:
                kv = name + b"\x12\x09\x21" + _DOUBLE(value)
            elif kind is int and 0 <= value < 0x80:
                kv = name + b"\x12\x02\x18" + _BYTE[value]
            else:
                kv = name + field(b"\x12", any_value(value))
            out.append(field(b"\x4a", kv))

    def spans(self, trace: WireTrace) -> list[bytes]:
        """Each span of one request as a ``ScopeSpans.spans`` field: the root's parent is the client's span (remote)
        or none, every other span's the one it names; all keep the trace's ``tracestate``."""
        trace_id = field(b"\x0a", ((trace.trace_hi << 64) | trace.trace_lo).to_bytes(16, "big"))
        state = field(b"\x1a", trace.trace_state.encode()) if trace.trace_state else b""
        return [field(b"\x12", self._span(s, trace_id, state, trace.remote_parent)) for s in trace.spans]

    def _span(self, s: WireSpan, trace_id: bytes, state: bytes, remote_parent: int) -> bytes:
        parent = s.parent_id or remote_parent
        if s.error is None:
            status = b"\x7a\x00"
        else:
            message = field(b"\x12", s.error.encode()) if s.error else b""
            status = field(b"\x7a", message + b"\x18" + varint(STATUS_ERROR))
        parts = [
            trace_id,
            b"\x12\x08", s.span_id.to_bytes(8, "big"),
            state,
            b"\x22\x08" + parent.to_bytes(8, "big") if parent else b"",
            field(b"\x2a", s.name.encode()),
            b"\x30", varint(s.kind + 1),  # trace.proto's SpanKind counts from UNSPECIFIED = 0
            b"\x39", _FIXED64(s.start_ns),
            b"\x41", _FIXED64(s.end_ns),
        ]
        self._fields(s.attributes, parts)
        parts += (status, b"\x85\x01", _FIXED32(HAS_IS_REMOTE | (IS_REMOTE if s.parent_id == 0 and remote_parent else 0)))
        return b"".join(parts)

    def request(self, spans: Iterable[bytes]) -> bytes:
        """An ``ExportTraceServiceRequest`` of encoded spans (:meth:`spans`): one resource, one scope."""
        scope_spans = field(b"\x12", self._scope + b"".join(spans))
        return field(b"\x0a", self._head + scope_spans + self._tail)
