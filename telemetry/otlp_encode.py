"""OTLP/protobuf bytes for :class:`~telemetry.otel_pipe.WireTrace` spans, written directly: the exporter
process's encoder (telemetry/otel_export.py).

Why not the SDK's: its span objects and its encoder, which builds a protobuf message object per span, attribute
and value in Python, cost the exporter 134-147 us per request of 5 spans and ~39 attributes, and at 100% sampling
that CPU comes from the cores the gateway serves on. This writes the same messages (``ExportTraceServiceRequest``
of opentelemetry-proto, the fields the SDK's encoder sets, with the same values) as bytes: ~10 us of the
exporter's ~13 us per gateway request (``python -m bench.otel_spans``; docs/runs/2026-12-07-otel-record), with
each key's encoded forms kept (:class:`_Key`).
``tests/telemetry/test_otlp_encode.py`` parses its output with the official protobuf classes and checks it equals
what the SDK's encoder makes of the same spans, so the two cannot drift apart unnoticed.

Proto3 wire format: a field is (number << 3 | wire type) as a varint, then a varint, 8 or 4 little-endian bytes,
or a length-prefixed payload. Fields at their default are left out, except a value of an ``AnyValue`` (a oneof
keeps its presence, so an empty string or a 0 is written) and a span's ``status`` (a message the SDK always
sets, so an unset status is an empty one).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable, Mapping

from telemetry.otel_pipe import LAYOUTS, Value, WireTrace

_DOUBLE = struct.Struct("<d").pack
_FIXED32 = struct.Struct("<I").pack
_SPAN_ID = struct.Struct(">BBQ").pack  # a span id field: tag, length 8, the id's bytes (big-endian, as the SDK)
_TIMES = struct.Struct("<BQBQ").pack  # start_time_unix_nano (7) and end_time_unix_nano (8), fixed64 each

# span flags (trace.proto SpanFlags): the parent's is-remote bit is known, and set when the parent is remote
HAS_IS_REMOTE, IS_REMOTE = 0x100, 0x200
STATUS_ERROR = 2  # opentelemetry.trace.StatusCode.ERROR
_KINDS = (b"\x30\x01", b"\x30\x02", b"\x30\x03", b"\x30\x04", b"\x30\x05")  # Span.kind: the SDK's + 1
_OK = b"\x7a\x00"  # Span.status (15): an empty Status, which the SDK always sets
_LOCAL = b"\x85\x01" + _FIXED32(HAS_IS_REMOTE)  # Span.flags (16): the parent is not remote
_REMOTE = b"\x85\x01" + _FIXED32(HAS_IS_REMOTE | IS_REMOTE)
MAX_CACHED = 4096  # keys, span names, and string attributes' fields remembered (slice, pool, rule, model repeat)


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


def _error(message: str) -> bytes:
    """A failed span's ``status`` (15): its description (2), if any, and code ERROR (3)."""
    return field(b"\x7a", (field(b"\x12", message.encode()) if message else b"") + b"\x18" + varint(STATUS_ERROR))


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


class _Key:
    """One attribute key's encoded forms: a float's and a small int's ``Span.attributes`` field up to the value's
    bytes, a bool's two whole fields, and the whole fields of the string values seen under it."""

    __slots__ = ("name", "float_head", "int_head", "bools", "strings")

    def __init__(self, key: str) -> None:
        self.name = field(b"\x0a", key.encode())  # KeyValue.key
        self.float_head = _head(self.name, b"\x12\x09\x21", 8)  # KeyValue.value: AnyValue.double_value, 8 bytes
        self.int_head = _head(self.name, b"\x12\x02\x18", 1)  # AnyValue.int_value, a one-byte varint
        self.bools = (field(b"\x4a", self.name + b"\x12\x02\x10\x00"), field(b"\x4a", self.name + b"\x12\x02\x10\x01"))
        self.strings: dict[str, bytes] = {}


def _head(name: bytes, value_head: bytes, value_bytes: int) -> bytes:
    """A ``Span.attributes`` field's bytes before a value of ``value_bytes`` bytes: tag, length, key, value's head."""
    n = len(name) + len(value_head) + value_bytes
    return b"\x4a" + (_BYTE[n] if n < 0x80 else varint(n)) + name + value_head


class Encoder:
    """Spans to OTLP bytes for one service: ``resource_attributes`` (the SDK's ``Resource.attributes``, which the
    exporter takes from ``Resource.create``) and the ``scope`` name, as the SDK's encoder writes them."""

    def __init__(self, resource_attributes: Mapping[str, object], scope: str, resource_schema_url: str = "") -> None:
        self._keys: dict[str, _Key] = {}  # keys are the code's own: a few dozen
        self._layouts: dict[int, list[_Key]] = {}
        self._cached = 0  # string fields remembered, over every key
        self._names: dict[str, bytes] = {}  # span names' fields
        self._head = field(b"\x0a", self._resource(resource_attributes))  # ResourceSpans.resource
        self._tail = field(b"\x1a", resource_schema_url.encode()) if resource_schema_url else b""
        self._scope = field(b"\x0a", field(b"\x0a", scope.encode()))  # ScopeSpans.scope: its name

    @staticmethod
    def _resource(attributes: Mapping[str, object]) -> bytes:
        """A resource's ``KeyValue`` fields (field 1), encoded once per process, not cached."""
        return b"".join(field(b"\x0a", field(b"\x0a", k.encode()) + field(b"\x12", any_value(v)))
                        for k, v in attributes.items())

    def _key(self, key: str) -> _Key:
        k = self._keys.get(key)
        if k is None:
            if len(self._keys) >= MAX_CACHED:
                self._keys.clear()
                self._layouts.clear()
                self._cached = 0
            k = self._keys[key] = _Key(key)
        return k

    def _pairs(self, attributes: dict[str, Value] | list[Value | None]) -> Iterable[tuple[_Key, Value | None]]:
        if type(attributes) is dict:
            keys = self._keys
            return zip([keys.get(key) or self._key(key) for key in attributes], attributes.values())
        keys = self._layouts.get(attributes[0])
        if keys is None:
            keys = self._layouts[attributes[0]] = [self._key(key) for key in LAYOUTS[attributes[0]]]
        return zip(keys, itertools.islice(attributes, 1, None), strict=True)

    def _fields(self, attributes: dict[str, Value] | list[Value | None], out: list[bytes]) -> None:
        """Append a span's attributes to ``out`` as ``Span.attributes`` fields (9), the unset values of a layout
        left out. Each key's encoded forms are kept (:class:`_Key`), and its string values' fields, up to
        ``MAX_CACHED`` of those in all (then forgotten all at once): request ids never repeat, slices and pools
        always do. This is the exporter's hot loop, most of its CPU."""
        for k, value in self._pairs(attributes):
            kind = type(value)
            if kind is str:
                entry = k.strings.get(value)
                if entry is None:
                    if self._cached >= MAX_CACHED:
                        for known in self._keys.values():
                            known.strings.clear()
                        self._cached = 0
                    entry = k.strings[value] = field(b"\x4a", k.name + field(b"\x12", field(b"\x0a", value.encode())))
                    self._cached += 1
                out.append(entry)
            elif kind is float:
                out.append(k.float_head + _DOUBLE(value))
            elif kind is int and 0 <= value < 0x80:
                out.append(k.int_head + _BYTE[value])
            elif kind is bool:
                out.append(k.bools[value])
            elif value is not None:
                out.append(field(b"\x4a", k.name + field(b"\x12", any_value(value))))

    def spans(self, trace: WireTrace) -> list[bytes]:
        """Each span of one request as a ``ScopeSpans.spans`` field: the root's parent is the client's span (remote)
        or none, every other span's the one it names; all keep the trace's ``tracestate``."""
        trace_id = field(b"\x0a", ((trace.trace_hi << 64) | trace.trace_lo).to_bytes(16, "big"))
        state = field(b"\x1a", trace.trace_state.encode()) if trace.trace_state else b""
        remote_parent, names, out = trace.remote_parent, self._names, []
        for s in trace.spans:
            parent = s.parent_id or remote_parent
            name = names.get(s.name) or self._name(s.name)
            parts = [trace_id, _SPAN_ID(0x12, 8, s.span_id), state, _SPAN_ID(0x22, 8, parent) if parent else b"",
                     name, _KINDS[s.kind], _TIMES(0x39, s.start_ns, 0x41, s.end_ns)]
            if s.attributes:
                self._fields(s.attributes, parts)
            parts.append(_OK if s.error is None else _error(s.error))
            parts.append(_REMOTE if s.parent_id == 0 and remote_parent else _LOCAL)
            span = b"".join(parts)
            n = len(span)
            out.append(b"\x12" + (_BYTE[n] if n < 0x80 else varint(n)) + span)
        return out

    def _name(self, name: str) -> bytes:
        if len(self._names) >= MAX_CACHED:
            self._names.clear()
        encoded = self._names[name] = field(b"\x2a", name.encode())
        return encoded

    def request(self, spans: Iterable[bytes]) -> bytes:
        """An ``ExportTraceServiceRequest`` of encoded spans (:meth:`spans`): one resource, one scope."""
        scope_spans = field(b"\x12", self._scope + b"".join(spans))
        return field(b"\x0a", self._head + scope_spans + self._tail)
