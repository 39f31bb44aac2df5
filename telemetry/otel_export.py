"""The gateway's exporter process: :class:`telemetry.otel_pipe.WireTrace` frames (the worker's) or
:class:`telemetry.otel_gateway.GatewayTrace` ones (the gateway's) on stdin, OTLP/HTTP out.

    python -m telemetry.otel_export SERVICE_NAME      # started by the gateway (telemetry/otel_pipe.SpanPipe)

Each frame's spans are encoded to OTLP protobuf (telemetry/otlp_encode.py: the messages the SDK's encoder
makes, at a fifth of its CPU) and sent in batches by the SDK's ``OTLPSpanExporter``'s HTTP client (endpoint,
headers, compression, timeout and retries from the OTEL_EXPORTER_OTLP_* variables the gateway was started
with: :func:`sender`; on the SDK's urllib3 transport where it sends as requests would: :func:`span_exporter`). Batches as the SDK's batch processor makes them: at most
``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` spans (512), sent when full or ``OTEL_BSP_SCHEDULE_DELAY`` ms (5000) after
their first span. There is no second queue here: while an export runs (or retries) nothing is read, the pipe
fills, and the gateway's bounded buffer is the one place spans wait or are dropped, and counted
(``specgate_otel_dropped_traces_total``); a send the collector refuses, or that fails after the client's retries,
is counted there too (:class:`Reporter`). It runs only on CPU time nothing else wants (:func:`yield_cpu`;
``SPECGATE_OTEL_EXPORTER_PRIORITY=normal`` gives it the gateway's priority): on a saturated host requests come
first and spans wait, then drop. At the end of stdin (the gateway closed the pipe, or died) it sends what it holds and exits.
Interrupts are ignored: a Ctrl-C or a SIGTERM sent to the whole process group reaches the gateway too, which
closes the pipe when it has written everything.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from collections.abc import Callable, Mapping

import msgspec
import requests.utils
from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.environment_variables import OTEL_BSP_MAX_EXPORT_BATCH_SIZE, OTEL_BSP_SCHEDULE_DELAY
from opentelemetry.sdk.resources import Resource

from telemetry.otel_gateway import GatewayTrace, spans_of
from telemetry.otel_pipe import FRAME_HEADER, WireTrace
from telemetry.otlp_encode import Encoder

PRIORITY_VAR = "SPECGATE_OTEL_EXPORTER_PRIORITY"  # idle (the default) or normal
READ_BYTES = 1 << 16
SCOPE = "specgate"  # the spans' instrumentation scope
# variables under which requests, the SDK's default transport, would send differently from urllib3: a credential
# provider's session (the SDK's)
REQUESTS_ONLY_VARS = ("OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
                      "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER")
# the CA bundles requests reads itself, in its order; set, one replaces the SDK's certificate file too
# (requests.Session.merge_environment_settings), and the urllib3 transport is given the same file
CA_BUNDLE_VARS = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


def take_frames(buf: bytearray) -> list[bytes]:
    """The whole frames at the start of ``buf``, removed from it (a partial one stays for the next read)."""
    out, i = [], 0
    while i + FRAME_HEADER <= len(buf):
        end = i + FRAME_HEADER + int.from_bytes(buf[i:i + FRAME_HEADER], "big")
        if end > len(buf):
            break
        out.append(bytes(buf[i + FRAME_HEADER:end]))
        i = end
    del buf[:i]
    return out


def _settings(env: Mapping[str, str]) -> tuple[float, int, str]:
    """(schedule delay in seconds, batch size, CPU priority) from the environment, the SDK's defaults where unset."""
    def number(name: str, default: float) -> float:
        try:
            return float(env.get(name, "").strip() or default)
        except ValueError:
            print(f"specgate otel exporter: {name}={env[name]!r} is not a number; using {default:g}", file=sys.stderr)
            return default
    priority = env.get(PRIORITY_VAR, "").strip().lower() or "idle"
    if priority not in ("idle", "normal"):
        print(f"specgate otel exporter: {PRIORITY_VAR}={env[PRIORITY_VAR]!r} is not idle or normal; using idle",
              file=sys.stderr)
        priority = "idle"
    return (max(0.0, number(OTEL_BSP_SCHEDULE_DELAY, 5000)) / 1e3,
            max(1, int(number(OTEL_BSP_MAX_EXPORT_BATCH_SIZE, 512))), priority)


def yield_cpu() -> None:
    """Run only when the CPU has nothing else to do: Linux's SCHED_IDLE (a request's process that wakes takes the
    core at once: c1 p99 1.7-1.9 ms instead of 4-7 with nice 0-19, bench.gateway on the 2-core EPYC), or the
    lowest priority niceness gives where that policy is missing or refused."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # no such policy here, or a sandbox refuses it
        os.nice(19)


def span_exporter(env: Mapping[str, str]) -> OTLPSpanExporter:
    """The SDK's OTLP/HTTP span exporter as the environment configures it (endpoint, headers, TLS files,
    compression, timeout), on the SDK's urllib3 transport where that sends what its default, requests, would: ~0.18
    ms of CPU per 512-span batch instead of ~0.44, for requests reads the environment, netrc and proxies again on
    every send (docs/runs/2026-12-07-otel-traceparent-only). The CA bundle is the one requests would verify with:
    ``REQUESTS_CA_BUNDLE`` or ``CURL_CA_BUNDLE`` where set, else the SDK's certificate file, else requests' own
    (certifi). requests stays where urllib3 would differ: a proxy or a netrc entry for the endpoint, a CA
    directory (the SDK's urllib3 transport takes a file), a variable of ``REQUESTS_ONLY_VARS``. Reads the default
    transport's session (private to the pinned SDK, as :func:`sender`'s client)."""
    exporter = OTLPSpanExporter()
    session = getattr(exporter._client._transport, "_session", None)
    endpoint = exporter._endpoint
    if (session is None or any(env.get(name, "").strip() for name in REQUESTS_ONLY_VARS)
            or requests.utils.get_environ_proxies(endpoint) or requests.utils.get_netrc_auth(endpoint)):
        return exporter
    bundle = next((path for name in CA_BUNDLE_VARS if (path := env.get(name))), None)
    verify = bundle or (requests.utils.DEFAULT_CA_BUNDLE_PATH if session.verify is True else session.verify)
    if isinstance(verify, str) and os.path.isdir(verify):
        return exporter
    cert = session.cert
    exporter.shutdown()
    return OTLPSpanExporter(_transport=Urllib3HTTPTransport(verify=verify, cert=cert))


def sender(exporter: OTLPSpanExporter) -> Callable[[bytes], bool]:
    """Send an encoded ``ExportTraceServiceRequest`` with ``exporter``'s HTTP client: its endpoint, headers,
    compression, timeout and retries, as its own ``export`` would. That method's only input is the SDK's span
    objects, whose encoding is the CPU this process saves, so this reads one private attribute, ``_client``, of
    the pinned opentelemetry-exporter-otlp-proto-http; tests/integration/test_otel_pipe.py sends through it to a
    real OTLP/HTTP receiver. True when the collector took it (failures are logged by the client)."""
    client = exporter._client

    def send(data: bytes) -> bool:
        return client.export(data).success
    return send


class Reporter:
    """Tells the serving process, on this process's stdout (one decimal count a line), how many requests' spans
    a failed send lost: it counts them in ``specgate_otel_dropped_traces_total{reason="export_failed"}``. Never
    blocks: a count the pipe cannot take now is added to the next one."""

    def __init__(self, fd: int = 1) -> None:
        self.fd, self.pending = fd, 0
        os.set_blocking(fd, False)

    def __call__(self, traces: int) -> None:
        self.pending += traces
        if not self.pending:
            return
        try:
            os.write(self.fd, f"{self.pending}\n".encode())  # under PIPE_BUF: written whole or not at all
        except BlockingIOError:
            return
        except OSError:  # nobody reads it any more (the serving process is gone)
            pass
        self.pending = 0


class Batch:
    """Encoded spans waiting to be sent, with the request (frame) each came from, so that a failed send reports
    the requests it lost; a request whose spans two failed sends split is counted once."""

    def __init__(self, send: Callable[[bytes], bool], encoder: Encoder, lost: Callable[[int], None]) -> None:
        self._send, self.encoder, self.lost = send, encoder, lost
        self.spans: list[bytes] = []
        self.owners: list[int] = []  # the frame of each span, numbered in arrival order
        self.frames = 0
        self._lost_to = 0  # the last frame counted as lost

    def __len__(self) -> int:
        return len(self.spans)

    def add(self, trace: WireTrace | GatewayTrace) -> None:
        """Encode one request's spans into the batch (a record OTLP cannot carry raises, and adds nothing)."""
        spans = self.encoder.spans(spans_of(trace) if type(trace) is GatewayTrace else trace)
        self.frames += 1
        self.spans += spans
        self.owners += [self.frames] * len(spans)

    def send(self, n: int) -> None:
        """Send the first ``n`` spans as one request."""
        owners = self.owners[:n]
        ok = self._send(self.encoder.request(self.spans[:n]))
        del self.spans[:n], self.owners[:n]
        if not ok and owners:
            self.lost(len(set(owners)) - (owners[0] == self._lost_to))
            self._lost_to = owners[-1]


def run(fd: int, batch: Batch, schedule_s: float, batch_size: int) -> None:
    """Read frames from ``fd`` until its end, sending ``batch`` in requests of ``batch_size`` spans as the module
    docstring says."""
    decode = msgspec.msgpack.Decoder(WireTrace | GatewayTrace).decode
    buf = bytearray()
    due: float | None = None  # when the batch's first span has waited the schedule delay
    while True:
        timeout = None if due is None else max(0.0, due - time.monotonic())
        if select.select([fd], [], [], timeout)[0]:
            chunk = os.read(fd, READ_BYTES)
            if not chunk:
                break
            buf += chunk
            for payload in take_frames(buf):
                try:
                    batch.add(decode(payload))
                except (msgspec.DecodeError, ValueError, TypeError, OverflowError) as exc:  # never from this gateway
                    print(f"specgate otel exporter: skipped a frame it cannot read: {exc}", file=sys.stderr)
            if batch and due is None:
                due = time.monotonic() + schedule_s
            while len(batch) >= batch_size:
                batch.send(batch_size)
        if batch and due is not None and time.monotonic() >= due:
            batch.send(len(batch))
        if not batch:
            due = None
    if batch:  # the end of the pipe: what is left (a frame cut short by the gateway's death is not)
        batch.send(len(batch))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    schedule_s, batch_size, priority = _settings(os.environ)
    if priority == "idle":
        yield_cpu()
    resource = Resource.create({"service.name": argv[0]})  # and OTEL_RESOURCE_ATTRIBUTES, as the SDK reads them
    exporter = span_exporter(os.environ)
    report = Reporter()
    try:
        run(sys.stdin.fileno(), Batch(sender(exporter), Encoder(resource.attributes, SCOPE, resource.schema_url),
                                      report), schedule_s, batch_size)
    finally:
        report(0)  # a count the pipe could not take earlier
        exporter.shutdown()


if __name__ == "__main__":
    main()
