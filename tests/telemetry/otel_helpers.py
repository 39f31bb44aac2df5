"""Test helper: a ``TraceExport`` whose pipe keeps what it is shipped, read back through the exporter process's
own conversion (``telemetry/otel_export.readable_spans``) as the SDK spans it would send. The pipe itself, with a
real exporter process, is tested in tests/integration/test_otel_pipe.py."""

from __future__ import annotations

from typing import Any

import msgspec
from opentelemetry.sdk.resources import Resource

from telemetry.otel import TraceExport
from telemetry.otel_export import readable_spans
from telemetry.otel_pipe import WireTrace


class Shipped(list):
    """The traces shipped, each through a msgpack round trip (what the exporter process decodes)."""

    def ship(self, trace: WireTrace) -> None:
        self.append(msgspec.msgpack.decode(msgspec.msgpack.encode(trace), type=WireTrace))

    def spans(self) -> list:
        resource = Resource.create({"service.name": "test"})
        return [span for trace in self for span in readable_spans(trace, resource)]


def shipping(sampler: Any) -> tuple[TraceExport, Shipped]:
    shipped = Shipped()
    return TraceExport("test", sampler, shipped), shipped
