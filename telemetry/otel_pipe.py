"""The pipe from a serving process to its OpenTelemetry exporter process: the wire format and the writer.

The gateway spends ~130 us of CPU per request (docs/benchmarks.md, "Tracing"); the OpenTelemetry SDK's span
objects and OTLP protobuf encoding, on a thread of the same process, cost ~200 us more per sampled request, all
under the one GIL (0.28x the requests per second at 100% sampling), and in the worker the export thread took the
GIL from the engine's step loop 5 ms at a time. So a process only records: one :class:`WireTrace` per sampled
request (ids, times, attributes; ``telemetry/otel.Recording``), msgpack-framed into a pipe to its exporter
process, ``python -m telemetry.otel_export``, which encodes them as OTLP protobuf (the SDK encoder's messages)
and sends them with the SDK's OTLP/HTTP exporter's client. :meth:`SpanPipe.ship` never blocks: a full pipe leaves
frames in a bounded buffer, and past that whole requests' spans are dropped and counted; the exporter reports on
its stdout the requests whose spans a send then lost (the collector refused them, or could not be reached), and
those are counted too. An exporter process that dies is started again (at most once per ``RESTART_S``), and its
loss never reaches a request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

import msgspec
import structlog


log = structlog.get_logger("specgate.otel")

INTERNAL, SERVER, CLIENT = 0, 1, 2  # opentelemetry.trace.SpanKind's values
SAMPLED = 0x01  # W3C trace flags: sampled (RANDOM_ID_FLAG, 0x02, in telemetry/otel.py)
FRAME_HEADER = 4  # bytes of big-endian length before each frame
FLUSH_S = 0.02  # a frame waits at most this long in the buffer before a write is tried
FLUSH_BYTES = 64 * 1024  # a buffer this full is written at once
MAX_BUFFER = 8 * 1024 * 1024  # frames kept while the exporter process falls behind; past it, traces are dropped
RESTART_S = 10.0  # an exporter process that died is started again at most this often
CLOSE_TIMEOUT_S = 30.0  # the gateway's shutdown waits this long for its spans to be written and sent


Value = str | bool | int | float | list  # a list: of one of the others, as OTLP allows

# The gateway's request span carries ~30 attributes on every sampled request, each dispatch attempt 6-8, and its
# decide and relay spans 2 and 1. They travel as a list, ``[LAYOUT, value, ...]``, the values in the order of
# ``LAYOUTS[LAYOUT]``, None where an attribute is not set: no key travels, and a list is cheaper to build than a dict
# (and to encode: telemetry/otlp_encode.py). Other spans ship a dict.
GATEWAY_REQUEST, GATEWAY_DISPATCH, GATEWAY_DECIDE, GATEWAY_RELAY = 1, 2, 3, 4
LAYOUTS: dict[int, tuple[str, ...]] = {
    GATEWAY_DECIDE: ("specgate.slice", "specgate.rule"), GATEWAY_RELAY: ("specgate.stream",), GATEWAY_DISPATCH: (
    "specgate.attempt", "specgate.pool", "specgate.proposer", "specgate.draft_tokens", "server.address",
    "specgate.worker_rid", "specgate.resumed_at_token", "error.type"), GATEWAY_REQUEST: (
    "gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model", "gen_ai.request.max_tokens",
    "gen_ai.request.temperature", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
    "http.response.status_code", "specgate.request_id", "specgate.status", "specgate.route", "specgate.slice",
    "specgate.pool", "specgate.rule", "specgate.reason", "specgate.proposer", "specgate.draft_tokens",
    "specgate.explored", "specgate.exploration", "specgate.fallback", "specgate.retries", "specgate.worker",
    "specgate.verify_rounds", "specgate.accept_length", "specgate.draft_tokens_proposed",
    "specgate.draft_tokens_accepted", "specgate.ttft_ms", "specgate.tpot_ms", "specgate.overhead_ms",
    "specgate.slo.ttft_ms", "specgate.slo.tpot_ms", "specgate.slo_met", "error.type")}


class WireSpan(msgspec.Struct, array_like=True, gc=False):
    """One finished span: ``parent_id`` 0 is the request's root (its parent is the client's span, if any);
    ``error`` is the status description of a failed span (its ``error.type`` is among the attributes);
    ``attributes``: a dict, or a list in one of the ``LAYOUTS`` (read both with :func:`attribute_items`)."""

    name: str
    span_id: int
    parent_id: int
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Value] | list[Value | None]
    error: str | None = None


def attribute_items(attributes: dict[str, Value] | list[Value | None]) -> Iterable[tuple[str, Value]]:
    """A span's attributes as (key, value) pairs, in order, the unset ones of a layout left out."""
    if isinstance(attributes, dict):
        return attributes.items()
    return [(k, v) for k, v in zip(LAYOUTS[attributes[0]], itertools.islice(attributes, 1, None), strict=True)
            if v is not None]


class WireTrace(msgspec.Struct, array_like=True, gc=False, tag="w"):
    """One request's spans. The 128-bit trace id as two halves (msgpack integers are 64-bit); the client's span
    (``remote_parent``, 0: none), its trace flags and ``tracestate`` header, which the spans keep. Tagged: the
    gateway ships a ``telemetry/otel_gateway.GatewayTrace`` instead, and the exporter reads either."""

    trace_hi: int
    trace_lo: int
    remote_parent: int
    remote_flags: int
    trace_state: str
    spans: list[WireSpan]


class SpanPipe:
    """Frames of :class:`WireTrace` to an exporter process's stdin, written without blocking (module docstring).
    ``dropped``: traces dropped (buffer full, or no exporter process); ``restarts``: exporter processes started
    again after one died; ``on_drop(traces, reason)`` is told of each drop (the gateway's metric)."""

    def __init__(self, service: str, env: dict[str, str] | None = None, max_buffer: int = MAX_BUFFER,
                 restart_s: float = RESTART_S, on_drop: Callable[[int, str], None] | None = None) -> None:
        self.service, self.env, self.max_buffer, self.restart_s = service, env, max_buffer, restart_s
        self.on_drop = on_drop
        self.process: subprocess.Popen | None = None
        self._encode = msgspec.msgpack.Encoder().encode
        self._buf = bytearray()
        self._frames: collections.deque[int] = collections.deque()  # the buffered frames' sizes, oldest first
        self._head = 0  # bytes of the oldest frame written already
        self._timer: asyncio.TimerHandle | None = None
        self._started_at: float | None = None  # None: never started
        self._closed = False
        self.dropped = self.restarts = 0
        self._warned_at = -float("inf")
        self._reports = bytearray()  # the exporter's reports of requests lost to failed sends, a partial line

    def start(self) -> None:
        """Start the exporter process (it exits, after exporting what it holds, when this pipe closes)."""
        self._started_at = time.monotonic()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "telemetry.otel_export", self.service], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, env=_with_root(self.env), cwd=_ROOT)
        except OSError as exc:  # no process to export with: the gateway serves on, and says so
            self.process = None
            log.error("otel_exporter_start_failed", error=str(exc))
            return
        os.set_blocking(self.process.stdin.fileno(), False)
        os.set_blocking(self.process.stdout.fileno(), False)
        self._reports = bytearray()

    def ship(self, trace: WireTrace) -> None:
        """Queue one request's spans; never blocks, never raises."""
        if self._closed:
            return
        payload = self._encode(trace)
        if len(self._buf) + len(payload) > self.max_buffer:
            self._drop(1, "buffer_full")
            return
        self._buf += len(payload).to_bytes(FRAME_HEADER, "big")
        self._buf += payload
        self._frames.append(FRAME_HEADER + len(payload))
        if len(self._buf) >= FLUSH_BYTES:
            self.flush()
        elif self._timer is None:
            with contextlib.suppress(RuntimeError):  # no event loop (a benchmark's loop): the next flush writes it
                self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.flush()
        if self._buf and not self._closed:  # the pipe was full: try again shortly
            self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self._on_timer)

    def flush(self) -> None:
        """Write what the pipe takes now; the rest waits (a partial frame's remainder first). Reads the
        exporter's reports first (:meth:`collect`)."""
        self.collect()
        if not self._buf:
            return
        p = self.process
        if p is None or p.poll() is not None:
            self._lost()
            return
        try:
            n = os.write(p.stdin.fileno(), self._buf)
        except BlockingIOError:
            return
        except (BrokenPipeError, OSError):
            self._lost()
            return
        self._written(n)

    def collect(self) -> None:
        """Count the requests whose spans the exporter process reports it could not send (a collector that
        refused them, or was unreachable through the client's retries): ``export_failed``."""
        p = self.process
        if p is None or p.stdout is None or p.stdout.closed:
            return
        while True:
            try:
                chunk = os.read(p.stdout.fileno(), 4096)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            self._reports += chunk
        *lines, rest = self._reports.split(b"\n")
        self._reports = bytearray(rest)
        lost = sum(int(line) for line in lines if line.strip().isdigit())
        if lost:
            self._drop(lost, "export_failed")

    def _written(self, n: int) -> None:
        """``n`` bytes went into the pipe: the frames they complete leave the count."""
        del self._buf[:n]
        self._head += n
        while self._frames and self._head >= self._frames[0]:
            self._head -= self._frames.popleft()

    def _discard(self) -> int:
        """Empty the buffer; the frames it held, a partly written one included (the exporter drops a cut frame)."""
        frames = len(self._frames)
        self._buf.clear()
        self._frames.clear()
        self._head = 0
        return frames

    def _lost(self) -> None:
        """The exporter process is gone: what is buffered is lost with it (a partial frame cannot be resumed);
        start another one unless one was started within ``restart_s``."""
        self.collect()
        frames = self._discard()
        if frames:
            self._drop(frames, "exporter_gone")
        started = self._started_at
        if started is not None and time.monotonic() - started >= self.restart_s and not self._closed:
            code = self.process.poll() if self.process is not None else None
            log.warning("otel_exporter_restarted", exit_code=code)
            self._reap()
            self.restarts += 1
            self.start()

    def _drop(self, traces: int, why: str) -> None:
        self.dropped += traces
        if self.on_drop is not None:
            self.on_drop(traces, why)
        now = time.monotonic()
        if now - self._warned_at >= 10.0:  # one line per 10 s, with the running total
            self._warned_at = now
            log.warning("otel_traces_dropped", reason=why, dropped_total=self.dropped)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is buffered, close the pipe and let the exporter process send it, all within ``timeout_s``
        (a collector that is down must not hold the gateway's shutdown): what is not written by then is dropped
        (``shutdown``), and an exporter still busy then is killed."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        p = self.process
        if p is None:
            return
        deadline = time.monotonic() + timeout_s
        while self._buf and (left := deadline - time.monotonic()) > 0:
            if select.select([], [p.stdin.fileno()], [], left)[1]:
                self.flush()  # an exporter gone meanwhile: what is left is dropped there (exporter_gone)
        if self._buf:
            self._drop(self._discard(), "shutdown")
        self._reap(max(0.0, deadline - time.monotonic()))

    def _reap(self, timeout_s: float = 0.0) -> None:
        p = self.process
        if p is None:
            return
        with contextlib.suppress(OSError):
            p.stdin.close()
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("otel_exporter_killed", after_s=timeout_s)
            p.kill()
            p.wait()
        self.collect()  # what it reported up to its exit (its stdout is at its end now)
        with contextlib.suppress(OSError):
            p.stdout.close()
        self.process = None


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout this module is in


def _with_root(env: dict[str, str] | None) -> dict[str, str]:
    """``env`` (this process's by default) with this checkout first on PYTHONPATH: the exporter process imports
    ``telemetry`` from the same tree as the gateway, wherever it was started from. (It also starts in that
    directory: ``python -m`` puts its working directory before PYTHONPATH, so a gateway started from another
    checkout would have run that checkout's exporter.)"""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
    return env
