"""An OTLP/HTTP trace sink for ``bench.gateway``'s tracing arm: accepts ``POST /v1/traces`` and answers 200 with
an empty ``ExportTraceServiceResponse`` (zero bytes), counting what it received (posts, bytes, and the spans in
them, decoded with the official protobuf messages, so a benchmark can tell whether every request's spans arrived).
It stands in for a collector so the measurement is the gateway's own tracing cost, not a collector's.

    .venv/bin/python -m bench.otlp_sink --port 4318
"""

from __future__ import annotations

import argparse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class _Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a collector
    posts = 0
    received = 0
    spans = 0

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        _Sink.posts += 1
        _Sink.received += len(body)
        if self.path == "/v1/traces":
            request = ExportTraceServiceRequest.FromString(body)
            _Sink.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802 - the health check bench.processes.running polls
        text = f"{_Sink.posts} posts, {_Sink.received} bytes, {_Sink.spans} spans\n".encode()
        self.send_response(200)
        self.send_header("content-length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    ThreadingHTTPServer(("127.0.0.1", args.port), _Sink).serve_forever()


if __name__ == "__main__":
    main()
