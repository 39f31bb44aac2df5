"""OpenTelemetry traces (OTLP/HTTP export): the set-up both serving processes share, W3C trace-context
propagation, and a request's spans as it records them.

Not to be confused with ``gateway/tracing.py``, the opt-in *recording of requests for replay* (token ids in a
file): this module is distributed tracing for operators, spans that an OpenTelemetry collector receives.

Off unless configured, with the standard environment variables only (docs/operating.md, "Tracing"): an
endpoint in ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` turns it on;
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` keeps it off whatever else is set;
``OTEL_SERVICE_NAME`` names the process (default ``specgate-gateway`` / ``specgate-worker``);
``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` sample (the SDK's default: parentbased_always_on). Off,
:func:`configure` returns None and imports nothing of OpenTelemetry: a caller's ``if otel is None`` is all a
request pays. On, the SDK's sampler decides when a request arrives (:func:`arrived`); a sampled request's
spans are plain values, shipped when it ends to the process's exporter (``telemetry/otel_pipe.py``), which
encodes them as OTLP and sends them off the serving process.

Attribute names follow the OpenTelemetry GenAI semantic conventions (``gen_ai.*``) where one exists, and
``specgate.*`` for the decision (the same values as the answer's ``specgate`` object, docs/api.md).
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from telemetry.otel_pipe import INTERNAL, SAMPLED, SpanPipe, Value, WireSpan, WireTrace

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
RANDOM_ID_FLAG = 0x02  # W3C trace-context level 2: the trace id's low 56 bits are random (sampled is 0x01)
_TRACEPARENT = ("00-%032x-%016x-00", "00-%032x-%016x-01", "00-%032x-%016x-02", "00-%032x-%016x-03")  # by flags


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for trace export (module docstring)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return any(env.get(name, "").strip() for name in ENDPOINT_VARS)


class ClientContext(msgspec.Struct, frozen=True, gc=False):
    """A caller's valid ``traceparent`` (and ``tracestate``), as the SDK's propagator reads them."""

    trace_id: int
    span_id: int
    flags: int
    trace_state: str
    context: Any  # the SDK's Context, for the parent-based sampler


class TraceExport:
    """One process's sampler and exporter process (None where export is off)."""

    __slots__ = ("service", "sampler", "pipe", "_quick")

    def __init__(self, service: str, sampler: Any, pipe: Any) -> None:
        self.service, self.sampler, self.pipe = service, sampler, pipe
        self._quick = quick_decision(sampler)

    def decide(self, client: ClientContext | None, name: str) -> tuple[int, bool]:
        """The request's trace id and whether it is sampled: the SDK's sampler, asked as it would ask for the
        request's root span (parent-based on the caller's flags where there is a caller's context)."""
        trace_id = client.trace_id if client is not None else (random.getrandbits(128) or 1)
        if self._quick is not None:
            return trace_id, self._quick(client, trace_id)
        parent = client.context if client is not None else None
        return trace_id, self.sampler.should_sample(parent, trace_id, name).decision.is_sampled()

    def start(self) -> None:
        """Start the exporter process (in the serving process, after any fork)."""
        self.pipe.start()

    def shutdown(self) -> None:
        self.pipe.close()


def quick_decision(sampler: Any) -> Callable[[ClientContext | None, int], bool] | None:
    """The decision of the samplers ``OTEL_TRACES_SAMPLER`` names (always_on, always_off, traceidratio and their
    parentbased_ forms), as the SDK makes it, without its ``SamplingResult`` and context look-ups (~1 us of every
    request, sampled or not); None for any other sampler, which is asked itself. tests/telemetry/test_otel_sampling.py
    checks it against the SDK's ``should_sample``. Reads ``ParentBased``'s delegates (private, SDK pinned)."""
    from opentelemetry.sdk.trace import sampling  # tracing on only (the sampler is the SDK's already)

    def alone(s: Any) -> Callable[[int], bool] | None:  # a sampler that ignores the parent
        if s is sampling.ALWAYS_ON:
            return _always
        if s is sampling.ALWAYS_OFF:
            return _never
        if type(s) is sampling.TraceIdRatioBased:
            return functools.partial(_below, s.TRACE_ID_LIMIT, s.bound)
        return None

    if type(sampler) in (sampling.ParentBased, sampling.ParentBasedTraceIdRatio):
        root, sampled, unsampled = (alone(sampler._root), alone(sampler._remote_parent_sampled),
                                    alone(sampler._remote_parent_not_sampled))
        if root is None or sampled is None or unsampled is None:
            return None
        return lambda client, trace_id: (root if client is None else sampled if client.flags & SAMPLED
                                         else unsampled)(trace_id)
    if (rule := alone(sampler)) is None:
        return None
    return lambda client, trace_id: rule(trace_id)


def _always(trace_id: int) -> bool:
    return True


def _never(trace_id: int) -> bool:
    return False


def _below(limit: int, bound: int, trace_id: int) -> bool:
    return trace_id & limit < bound  # TraceIdRatioBased: the trace id's low 64 bits against the rate's bound


def configure(default_service: str, env: Mapping[str, str] | None = None,
              on_drop: Callable[[int, str], None] | None = None) -> TraceExport | None:
    """A ``TraceExport`` when ``env`` (the process's, by default) asks for trace export, else None; the sampler is
    the SDK's, which reads OTEL_TRACES_SAMPLER(_ARG) from the process's environment. ``on_drop(traces, reason)``:
    told of spans dropped before the exporter process got them (the gateway's metric)."""
    env = os.environ if env is None else env
    if not enabled(env):
        return None
    from opentelemetry.sdk.trace import TracerProvider  # ~0.1 s: tracing on only

    service = env.get("OTEL_SERVICE_NAME", "").strip() or default_service
    sampler = TracerProvider().sampler  # a provider without processors: the SDK's OTEL_TRACES_SAMPLER(_ARG) reading
    return TraceExport(service, sampler, SpanPipe(service, dict(env), on_drop=on_drop))


def client_context(headers: Any) -> ClientContext | None:
    """The W3C trace context (``traceparent``, ``tracestate``) a request carries, read by the SDK's propagator;
    None without a valid one (the request then starts a trace). ``headers``: any mapping with lower-case
    ``get``."""
    parent = headers.get(TRACEPARENT)
    if not parent:
        return None
    carrier = {TRACEPARENT: parent}
    if state := headers.get(TRACESTATE):
        carrier[TRACESTATE] = state
    propagator, current_span = _propagation()
    ctx = propagator.extract(carrier)
    sc = current_span(ctx).get_span_context()
    if not sc.is_valid:
        return None
    return ClientContext(sc.trace_id, sc.span_id, int(sc.trace_flags), sc.trace_state.to_header(), ctx)


@functools.cache
def _propagation() -> tuple[Any, Callable[[Any], Any]]:
    """The SDK's W3C propagator and ``get_current_span``, imported on first use (never while tracing is off)."""
    from opentelemetry.trace import get_current_span  # ~0.05 s, once: tracing on only
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # see above

    return TraceContextTextMapPropagator(), get_current_span


def new_span_id() -> int:
    return random.getrandbits(64) or 1


def arrived(export: TraceExport, headers: Any, name: str) -> tuple[ClientContext | None, int, dict[str, str] | None]:
    """A request's trace when it arrives: the caller's context (None: it starts the trace), the trace id, and
    ``None`` when the sampler records it; when it does not, the headers that every call it makes upstream carries
    (:func:`unsampled_headers`). The unsampled build nothing else: at a low sampling rate nearly every request
    takes that path, and under load it costs several times what it takes alone
    (docs/runs/2026-12-07-otel-traceparent-only)."""
    client = client_context(headers)
    trace_id, sampled = export.decide(client, name)
    return client, trace_id, None if sampled else unsampled_headers(client, trace_id)


def unsampled_headers(client: ClientContext | None, trace_id: int) -> dict[str, str]:
    """What an unsampled request sends on: its trace id, a parent span id that no exported span carries (nothing
    of it is recorded), and the sampled flag clear, so the next process's parent-based sampler records nothing
    either; the caller's ``tracestate``, kept."""
    headers = {TRACEPARENT: _TRACEPARENT[_flags(client, False)] % (trace_id, new_span_id())}
    if client is not None and client.trace_state:
        headers[TRACESTATE] = client.trace_state
    return headers


def _flags(client: ClientContext | None, sampled: bool) -> int:
    """The W3C trace flags a request sends on: a new trace's id is random (level 2's flag), a caller's keeps its
    own random flag; the sampled bit is the decision."""
    return (RANDOM_ID_FLAG if client is None else client.flags & RANDOM_ID_FLAG) | (SAMPLED if sampled else 0)


class Recording:
    """One sampled request's spans in one process: its trace's ids, the spans recorded, and the ``traceparent`` it
    sends on. Built once :func:`arrived` has found the request sampled (an unsampled one gets only its headers)."""

    __slots__ = ("_export", "trace_id", "root_id", "_client", "_traceparent", "_state", "spans")

    def __init__(self, export: TraceExport, client: ClientContext | None, trace_id: int) -> None:
        self._export = export
        self._client = client
        self.trace_id = trace_id
        self._state = client.trace_state if client is not None else ""
        self._traceparent = _TRACEPARENT[_flags(client, True)]  # the header's format (its flags written in)
        self.root_id = new_span_id()
        self.spans: list[WireSpan] = []

    def traceparent(self, span_id: int) -> dict[str, str]:
        """Headers naming ``span_id`` (a dispatch attempt's) as the parent of an upstream request."""
        headers = {TRACEPARENT: self._traceparent % (self.trace_id, span_id)}
        if self._state:
            headers[TRACESTATE] = self._state
        return headers

    def child(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any] | None = None,
              kind: int = INTERNAL) -> WireSpan:
        """Record a child of the request's span (``end_ns`` 0: still open; it ends with the request)."""
        span = WireSpan(name, new_span_id(), self.root_id, kind, start_ns, end_ns, attributes or {})
        self.spans.append(span)
        return span

    def ship(self, name: str, kind: int, start_ns: int, end_ns: int,
             attributes: dict[str, Value] | list[Value | None], error: str | None = None) -> None:
        """Record the request's own span, end the children still open, and hand the spans to the exporter."""
        for span in self.spans:
            if span.end_ns == 0:
                span.end_ns = end_ns
        self.spans.append(WireSpan(name, self.root_id, 0, kind, start_ns, end_ns, attributes, error))
        client = self._client
        self._export.pipe.ship(WireTrace(self.trace_id >> 64, self.trace_id & 0xFFFF_FFFF_FFFF_FFFF,
                                         client.span_id if client is not None else 0,
                                         client.flags if client is not None else 0, self._state, self.spans))


def operation(endpoint: str) -> str:
    """``gen_ai.operation.name`` of an OpenAI endpoint (``chat`` or ``completions``)."""
    return "chat" if endpoint == "chat" else "text_completion"


def attributes(values: Mapping[str, Any]) -> dict[str, Any]:
    """Span attributes without the Nones (OpenTelemetry refuses None values)."""
    return {k: v for k, v in values.items() if v is not None}
