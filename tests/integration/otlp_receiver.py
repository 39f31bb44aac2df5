"""A tiny OTLP/HTTP trace receiver for the tests: ``POST /v1/traces`` bodies decoded with the official protobuf
messages (``ExportTraceServiceRequest``), the spans kept in memory with their service's name."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 2 SERVER, 3 CLIENT
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    start_ns: int
    end_ns: int


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.posts = 0
        self._lock = threading.Lock()

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        found = []
        for resource_spans in request.resource_spans:
            service = next((_value(a.value) for a in resource_spans.resource.attributes if a.key == "service.name"),
                           "")
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    found.append(ReceivedSpan(
                        service=service, name=s.name, kind=s.kind, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in s.attributes}, status_code=s.status.code,
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano))
        with self._lock:
            self.posts += 1
            self.spans.extend(found)

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def trace_of_request(self, request_id: str, timeout_s: float = 60.0) -> str:
        """The trace id of the gateway span whose ``specgate.request_id`` is ``request_id`` ("" if none came)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                found = [s.trace_id for s in self.spans if s.attributes.get("specgate.request_id") == request_id]
            if found:
                return found[0]
            time.sleep(0.1)
        return ""

    def wait_for(self, trace_id: str, names: set[tuple[str, str]], timeout_s: float = 60.0) -> list[ReceivedSpan]:
        """The trace's spans once every (service, name) in ``names`` arrived (a deadline only a hang passes)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.of_trace(trace_id)
            if names <= {(s.service, s.name) for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


@contextlib.contextmanager
def otlp_receiver() -> Iterator[tuple[str, Receiver]]:
    """(endpoint for ``OTEL_EXPORTER_OTLP_ENDPOINT``, the receiver), served on a thread until the block ends."""
    receiver = Receiver()
    ok = ExportTraceServiceResponse().SerializeToString()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.path == "/v1/traces":
                receiver.take(body)
                self.send_response(200)
            else:
                self.send_response(404)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(ok)))
            self.end_headers()
            self.wfile.write(ok)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", receiver
    finally:
        server.shutdown()
        server.server_close()
