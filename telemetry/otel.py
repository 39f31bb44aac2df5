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
than block a request): in the worker's process, and for the gateway in an exporter process of its own
(``telemetry/otel_pipe.py``, which shares :func:`enabled`, :func:`extract` and the conventions here).

Attribute names follow the OpenTelemetry GenAI semantic conventions (``gen_ai.*``) where one exists, and
``specgate.*`` for the decision (the same values as the answer's ``specgate`` object, docs/api.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
RANDOM_ID_FLAG = 0x02  # W3C trace-context level 2: the trace id's low 56 bits are random (sampled is 0x01)


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for trace export (module docstring)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return any(env.get(name, "").strip() for name in ENDPOINT_VARS)


class Tracing:
    """One process's tracer and its provider (shut down, flushing what is queued, when the process stops)."""

    __slots__ = ("provider", "tracer", "service")

    def __init__(self, provider: TracerProvider, tracer: Tracer, service: str) -> None:
        self.provider, self.tracer, self.service = provider, tracer, service

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
    # the sampler comes from OTEL_TRACES_SAMPLER(_ARG) (the SDK reads them when none is passed)
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # endpoint, headers: OTEL_EXPORTER_OTLP_*
    return Tracing(provider, provider.get_tracer("specgate"), service)


class _Api:
    """The OpenTelemetry API pieces a request touches, imported once, on first use (never while tracing is off)."""

    def __init__(self) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context  # ~0.05 s: tracing on only
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # see above
        self.propagator = TraceContextTextMapPropagator()
        self.set_span_in_context = set_span_in_context
        self.server = SpanKind.SERVER
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


def child_context(span: Span) -> Context:
    return api().set_span_in_context(span)


def fail(span: Span, error_type: str, message: str) -> None:
    """Mark ``span`` failed (``error.type`` as the semantic conventions name it, status ERROR)."""
    a = api()
    span.set_attribute("error.type", error_type)
    span.set_status(a.status(a.error, message))


def server_kind() -> Any:
    return api().server


def operation(endpoint: str) -> str:
    """``gen_ai.operation.name`` of an OpenAI endpoint (``chat`` or ``completions``)."""
    return "chat" if endpoint == "chat" else "text_completion"


def attributes(values: Mapping[str, Any]) -> dict[str, Any]:
    """Span attributes without the Nones (OpenTelemetry refuses None values)."""
    return {k: v for k, v in values.items() if v is not None}
