"""OpenTelemetry traces (OTLP/HTTP export): the set-up both processes share, and W3C trace-context propagation.

Not to be confused with ``gateway/tracing.py``, the opt-in *recording of requests for replay* (token ids in a
file): this module is distributed tracing for operators, spans that an OpenTelemetry collector receives.

Off unless configured, with the standard environment variables only (docs/operating.md, "Tracing"): an
endpoint in ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` turns it on;
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` keeps it off whatever else is set;
``OTEL_SERVICE_NAME`` names the process (default ``specgate-gateway`` / ``specgate-worker``);
``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` sample (the SDK's default: parentbased_always_on);
``OTEL_BSP_*`` tune the batch processor. Off, :func:`configure` returns None and imports nothing of
OpenTelemetry: a caller's ``if tracer is None`` is all a request pays. On, spans are exported in batches by the
SDK's ``BatchSpanProcessor`` on its own thread, never on the request path (a full queue drops spans rather
than block a request).

Attribute names follow the OpenTelemetry GenAI semantic conventions (``gen_ai.*``) where one exists, and
``specgate.*`` for the decision (the same values as the answer's ``specgate`` object, docs/api.md).
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
RANDOM_ID_FLAG = 0x02  # W3C trace-context level 2: the trace id's low 56 bits are random (sampled is 0x01)
EXPORT_SWITCH_S = 0.0005  # the GIL switch interval of a gateway that exports traces (``yield_to_requests``)


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for trace export (module docstring)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return any(env.get(name, "").strip() for name in ENDPOINT_VARS)


class Tracing:
    """One process's tracer and its provider (shut down, flushing what is queued, when the process stops).
    ``ids``: the provider's id generator, a :func:`handed_ids` (:meth:`new_root` hands it trace ids)."""

    __slots__ = ("provider", "tracer", "service", "ids")

    def __init__(self, provider: TracerProvider, tracer: Tracer, service: str, ids: Any) -> None:
        self.provider, self.tracer, self.service, self.ids = provider, tracer, service, ids

    def new_root(self, name: str) -> tuple[int, bool]:
        """A new trace's id and the sampler's decision for its root span, before any span exists: an unsampled
        request then builds no span at all (the gateway's span code for it: 2.7 us instead of 5.8; a traced
        gateway samples a few percent of its requests). A sampled one's id is handed to the next span started
        (the request path starts it at once, with no await between), so the SDK's own decision, made again on
        the same id, agrees."""
        trace_id = random.getrandbits(128) or 1
        sampled = self.provider.sampler.should_sample(None, trace_id, name).decision.is_sampled()
        if sampled:
            self.ids.next_trace_id = trace_id
        return trace_id, sampled

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes the batch processor's queue (bounded by OTEL_BSP_EXPORT_TIMEOUT)


def configure(default_service: str, env: Mapping[str, str] | None = None) -> Tracing | None:
    """A ``Tracing`` exporting over OTLP/HTTP (protobuf) when the environment asks for it, else None."""
    env = os.environ if env is None else env
    if not enabled(env):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # ~0.1 s: tracing on only
    from opentelemetry.sdk.resources import Resource  # see above
    from opentelemetry.sdk.trace import TracerProvider  # see above
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # see above

    service = env.get("OTEL_SERVICE_NAME", "").strip() or default_service
    ids = handed_ids()
    # the sampler comes from OTEL_TRACES_SAMPLER(_ARG) (the SDK reads them when none is passed)
    provider = TracerProvider(resource=Resource.create({"service.name": service}), id_generator=ids)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # endpoint, headers: OTEL_EXPORTER_OTLP_*
    return Tracing(provider, provider.get_tracer("specgate"), service, ids)


def handed_ids() -> Any:
    """The id generator of a :class:`Tracing`'s provider: random ids (the SDK's own generator), except a trace id
    :meth:`Tracing.new_root` decided on, which the next span started takes."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator  # ~0.05 s: tracing on only

    class HandedIds(RandomIdGenerator):
        next_trace_id = 0

        def generate_trace_id(self) -> int:
            trace_id, self.next_trace_id = self.next_trace_id, 0
            return trace_id or super().generate_trace_id()

    return HandedIds()


def yield_to_requests() -> None:
    """Let the event loop take the GIL back from the batch processor's export thread within 0.5 ms instead of
    Python's 5 ms: the OTLP encoding runs in long pure-Python stretches, and a request arriving meanwhile waits
    for the rest of one (10% sampled, c1 p99 5.1 ms -> 1.6 ms, bench.gateway on the 2-core EPYC,
    docs/runs/2026-12-07-issue56-epyc). Process-wide; never lengthens an interval already shorter."""
    sys.setswitchinterval(min(sys.getswitchinterval(), EXPORT_SWITCH_S))


class _Api:
    """The OpenTelemetry API pieces a request touches, imported once, on first use (never while tracing is off)."""

    def __init__(self) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context  # ~0.05 s: tracing on only
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # see above
        self.propagator = TraceContextTextMapPropagator()
        self.set_span_in_context = set_span_in_context
        self.server, self.client = SpanKind.SERVER, SpanKind.CLIENT
        self.status, self.error = Status, StatusCode.ERROR


_api: _Api | None = None


def api() -> _Api:
    global _api
    if _api is None:
        _api = _Api()
    return _api


def extract(headers: Any) -> Context | None:
    """The W3C trace context (``traceparent``, ``tracestate``) a request carries; None without a traceparent
    (the span then starts a new trace). ``headers``: any mapping with lower-case ``get``."""
    parent = headers.get(TRACEPARENT)
    if not parent:
        return None
    carrier = {TRACEPARENT: parent}
    if state := headers.get(TRACESTATE):
        carrier[TRACESTATE] = state
    return api().propagator.extract(carrier)


def inject(span: Span) -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) naming ``span`` as the parent, for an upstream request (an unsampled
    span's says so, and the worker's parent-based sampler follows it)."""
    a = api()
    carrier: dict[str, str] = {}
    a.propagator.inject(carrier, context=a.set_span_in_context(span))
    return carrier


def unsampled_parent(trace_id: int) -> dict[str, str]:
    """The ``traceparent`` of a span that was never built because its trace is not sampled (W3C trace-context:
    version 00, the sampled flag clear and the random-trace-id flag set, as the SDK writes an unsampled span's):
    the worker's parent-based sampler follows it and builds none either."""
    return {TRACEPARENT: f"00-{trace_id:032x}-{random.getrandbits(64) or 1:016x}-{RANDOM_ID_FLAG:02x}"}


def child_context(span: Span) -> Context:
    return api().set_span_in_context(span)


def fail(span: Span, error_type: str, message: str) -> None:
    """Mark ``span`` failed (``error.type`` as the semantic conventions name it, status ERROR)."""
    a = api()
    span.set_attribute("error.type", error_type)
    span.set_status(a.status(a.error, message))


def server_kind() -> Any:
    return api().server


def client_kind() -> Any:
    return api().client


def operation(endpoint: str) -> str:
    """``gen_ai.operation.name`` of an OpenAI endpoint (``chat`` or ``completions``)."""
    return "chat" if endpoint == "chat" else "text_completion"


def attributes(values: Mapping[str, Any]) -> dict[str, Any]:
    """Span attributes without the Nones (OpenTelemetry refuses None values)."""
    return {k: v for k, v in values.items() if v is not None}
