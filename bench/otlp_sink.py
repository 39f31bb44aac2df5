"""An OTLP/HTTP trace sink for ``bench.gateway``'s tracing arm: accepts ``POST /v1/traces`` and answers 200 with
an empty ``ExportTraceServiceResponse`` (zero bytes), counting what it received (posts, bytes, and the spans in
them, so a benchmark can tell whether every request's spans arrived). It stands in for a collector so the
measurement is the gateway's own tracing cost, not a collector's. So it is light: uvicorn's C HTTP parser, and each
request read only as far as its spans (:func:`span_count`, which tests/bench/test_otlp_sink.py checks against a
full decode with the official messages). Its predecessor (http.server, a full decode) took ~6.4 us of CPU per
gateway request on the 2-core benchmark machine, whose cores the gateway being measured shares
(docs/runs/2026-12-07-otel-record).

    .venv/bin/python -m bench.otlp_sink --port 4318
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import uvicorn
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_SKIM = "specgate.bench.otlp_skim"


@functools.cache
def _skim_class() -> Any:
    """``ExportTraceServiceRequest`` read only down to its spans, each left as bytes (opentelemetry-proto's field
    numbers: ``ExportTraceServiceRequest.resource_spans`` 1, ``ResourceSpans.scope_spans`` 2, ``ScopeSpans.spans``
    2; every other field is skipped). A full decode parses every attribute of every span: ~2.7 us of CPU per
    gateway request, on the benchmark machine's cores, which the gateway being measured needs."""
    f = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="specgate_bench_otlp_skim.proto", package=_SKIM, syntax="proto3")
    for name, number, kind, type_name in (("ScopeSpans", 2, f.TYPE_BYTES, ""),
                                          ("ResourceSpans", 2, f.TYPE_MESSAGE, f".{_SKIM}.ScopeSpans"),
                                          ("Request", 1, f.TYPE_MESSAGE, f".{_SKIM}.ResourceSpans")):
        item = proto.message_type.add(name=name).field.add(name="items", number=number, type=kind,
                                                           label=f.LABEL_REPEATED)
        if type_name:
            item.type_name = type_name
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_SKIM}.Request"))


def span_count(body: bytes) -> int:
    """The spans in a serialized ``ExportTraceServiceRequest``."""
    return sum(len(scope.items) for resource in _skim_class().FromString(body).items for scope in resource.items)


class Sink:
    """The ASGI app: ``POST /v1/traces`` counted, ``GET`` any path the counts (``N posts, N bytes, N spans``)."""

    def __init__(self) -> None:
        self.posts = self.received = self.spans = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "POST":
            chunks, more = [], True
            while more:
                message = await receive()
                chunks.append(message.get("body", b""))
                more = message.get("more_body", False)
            body = b"".join(chunks)
            self.posts += 1
            self.received += len(body)
            traces = scope["path"] == "/v1/traces"
            if traces:
                self.spans += span_count(body)
            await _answer(send, 200 if traces else 404, b"", b"application/x-protobuf")
            return
        await _answer(send, 200, f"{self.posts} posts, {self.received} bytes, {self.spans} spans\n".encode(),
                      b"text/plain")


async def _answer(send: Any, status: int, body: bytes, kind: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", kind), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(Sink(), host="127.0.0.1", port=args.port, log_level="warning", lifespan="off", access_log=False)


if __name__ == "__main__":
    main()
