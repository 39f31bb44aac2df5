"""CPU per send of one 512-span OTLP batch to bench/otlp_sink.py: the SDK's client on requests (its default
transport), on the SDK's urllib3 transport, plain requests, and bare http.client for reference.

    .venv/bin/python docs/runs/2026-12-07-otel-traceparent-only/send_cost.py      # from the repository root
"""
import http.client
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
PORT, N = 43187, 300

sink = subprocess.Popen([sys.executable, "-m", "bench.otlp_sink", "--port", str(PORT)], cwd=ROOT)
time.sleep(2.5)
os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"http://127.0.0.1:{PORT}/v1/traces"

import msgspec  # noqa: E402 - after the endpoint is in the environment
import requests  # noqa: E402
from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport  # noqa: E402
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402

from bench.otel_spans import _Buffered, _request, _tracing, served_request  # noqa: E402
from telemetry.otel_export import SCOPE, sender, take_frames  # noqa: E402
from telemetry.otel_gateway import GatewayTrace, spans_of  # noqa: E402
from telemetry.otel_pipe import WireTrace  # noqa: E402
from telemetry.otlp_encode import Encoder  # noqa: E402

finished, record = served_request()
pipe = _Buffered(keep=True)
tracing = _tracing(1.0, pipe)
for _ in range(103):
    _request(tracing, finished, record)
decode = msgspec.msgpack.Decoder(WireTrace | GatewayTrace).decode
resource = Resource.create({"service.name": "bench"})
encoder = Encoder(resource.attributes, SCOPE, resource.schema_url)
spans = []
for payload in take_frames(pipe._buf):
    spans += encoder.spans(spans_of(decode(payload)))
data = encoder.request(spans[:512])
print("batch bytes", len(data), "spans", min(512, len(spans)))


def timed(name, send):
    for _ in range(20):
        send()
    c0 = time.process_time()
    for _ in range(N):
        send()
    print(f"{name}: {1e3 * (time.process_time() - c0) / N:.3f} ms CPU per send")


try:
    on_requests = sender(OTLPSpanExporter())
    timed("SDK client, requests transport", lambda: on_requests(data))
    on_urllib3 = sender(OTLPSpanExporter(_transport=Urllib3HTTPTransport(verify=True, cert=None)))
    timed("SDK client, urllib3 transport", lambda: on_urllib3(data))
    session = requests.Session()
    url, head = f"http://127.0.0.1:{PORT}/v1/traces", {"Content-Type": "application/x-protobuf"}
    timed("plain requests session", lambda: session.post(url, data=data, headers=head))
    conn = http.client.HTTPConnection("127.0.0.1", PORT)

    def bare():
        conn.request("POST", "/v1/traces", body=data, headers=head)
        conn.getresponse().read()
    timed("bare http.client", bare)
finally:
    sink.terminate()
