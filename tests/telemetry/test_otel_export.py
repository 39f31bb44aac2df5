"""The gateway's exporter process's loop (telemetry/otel_export.run) on a real OS pipe: frames become OTLP requests
of spans in batches of at most OTEL_BSP_MAX_EXPORT_BATCH_SIZE, a partial batch leaves OTEL_BSP_SCHEDULE_DELAY after its
first span without waiting for more, what is left goes at the end of the pipe, and a frame cut short is not
exported. A send that fails reports the requests it lost, each once, on a pipe that never blocks the exporter.
The settings read the SDK's variables, and a bad value is named."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import msgspec
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource

from telemetry.otel_export import SCOPE, Batch, Reporter, _settings, run, take_frames
from telemetry.otel_pipe import FRAME_HEADER, SERVER, WireSpan, WireTrace
from telemetry.otlp_encode import Encoder

RESOURCE = Resource.create({"service.name": "t"})


def _frame(n: int) -> bytes:
    payload = msgspec.msgpack.encode(WireTrace(0, n, 0, 0, "", [WireSpan("chat", n, 0, SERVER, 1, 2, {"n": n})]))
    return len(payload).to_bytes(FRAME_HEADER, "big") + payload


class Batches(list):
    """What the loop sent, request by request (each span's ``n`` attribute, read back by the official protobuf
    classes), and an event per request."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = threading.Event()

    def __call__(self, data: bytes) -> bool:
        self.append(_ns(data))
        self.sent.set()
        return True


def _ns(data: bytes) -> list[int]:
    """Each span's ``n`` attribute in an encoded request, read back by the official protobuf classes."""
    request = ExportTraceServiceRequest.FromString(data)
    return [span.attributes[0].value.int_value for rs in request.resource_spans for ss in rs.scope_spans
            for span in ss.spans]


def _loop(batches: Batches, schedule_s: float, batch_size: int) -> tuple[int, threading.Thread]:
    read, write = os.pipe()
    batch = Batch(batches, Encoder(RESOURCE.attributes, SCOPE), lost=batches.append)
    thread = threading.Thread(target=run, args=(read, batch, schedule_s, batch_size))
    thread.start()
    return write, thread


def test_full_batches_leave_at_once_and_the_rest_at_the_end_of_the_pipe():
    batches = Batches()
    write, thread = _loop(batches, schedule_s=3600.0, batch_size=3)
    os.write(write, b"".join(_frame(n) for n in range(1, 8)) + _frame(8)[:-1])  # 7 whole frames, one cut short
    assert batches.sent.wait(60)
    os.close(write)
    thread.join(60)
    assert batches == [[1, 2, 3], [4, 5, 6], [7]]


def test_a_partial_batch_leaves_after_the_schedule_delay_without_more_spans():
    batches = Batches()
    write, thread = _loop(batches, schedule_s=0.05, batch_size=512)
    os.write(write, _frame(1) + _frame(2))
    assert batches.sent.wait(60)  # the pipe is still open: the delay, not its end, sent them
    assert batches == [[1, 2]]
    os.close(write)
    thread.join(60)
    assert batches == [[1, 2]]


def test_frames_split_across_reads_are_put_back_together():
    buf = bytearray(_frame(1) + _frame(2)[:5])
    assert [msgspec.msgpack.decode(p, type=WireTrace).trace_lo for p in take_frames(buf)] == [1]
    buf += _frame(2)[5:]
    assert [msgspec.msgpack.decode(p, type=WireTrace).trace_lo for p in take_frames(buf)] == [2] and buf == b""


def test_settings_are_the_sdks_variables_and_a_bad_value_is_named(capsys):
    assert _settings({}) == (5.0, 512, "idle")
    assert _settings({"OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "64",
                      "SPECGATE_OTEL_EXPORTER_PRIORITY": "Normal"}) == (0.2, 64, "normal")
    assert _settings({"OTEL_BSP_SCHEDULE_DELAY": "soon", "SPECGATE_OTEL_EXPORTER_PRIORITY": "high"}) == \
        (5.0, 512, "idle")
    err = capsys.readouterr().err
    assert "OTEL_BSP_SCHEDULE_DELAY='soon' is not a number; using 5000" in err
    assert "SPECGATE_OTEL_EXPORTER_PRIORITY='high' is not idle or normal; using idle" in err


def test_the_exporter_process_runs_on_idle_cpu_time_only():
    """In a child process (the policy is per process): SCHED_IDLE after ``yield_cpu``."""
    code = "import os; from telemetry.otel_export import yield_cpu; yield_cpu(); print(os.sched_getscheduler(0))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert int(out) == os.SCHED_IDLE


def test_a_failed_send_reports_the_requests_it_lost_each_once():
    """Requests of 2, 1 and 3 spans in sends of 2 spans: the third request is split across the last two sends;
    when both fail it is lost once, not twice; a send that succeeds reports nothing."""
    outcomes, sent, lost = [False, True, False, False], [], []

    def send(data: bytes) -> bool:
        sent.append(_ns(data))
        return outcomes[len(sent) - 1]

    encoder = Encoder(RESOURCE.attributes, SCOPE)
    batch = Batch(send, encoder, lost.append)
    spans = {1: 2, 2: 1, 3: 3}
    for n, count in spans.items():
        batch.add(WireTrace(0, n, 0, 0, "", [WireSpan("s", 10 * n + i, 0, SERVER, 1, 2, {"n": n})
                                             for i in range(count)]))
    while batch:
        batch.send(2)
    assert sent == [[1, 1], [2, 3], [3, 3]]
    assert lost == [1, 1] and sum(lost) == 2  # request 1; request 3 (in two failed sends), once


def _drain(fd: int) -> bytes:
    """What a non-blocking pipe holds now."""
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def test_reports_never_block_and_a_count_that_did_not_fit_goes_with_the_next():
    read, write = os.pipe()
    os.set_blocking(read, False)
    report = Reporter(write)
    report(2)
    assert _drain(read) == b"2\n"
    while True:  # fill the pipe: the next report cannot be written now
        try:
            os.write(write, b"x" * 4096)
        except BlockingIOError:
            break
    report(3)  # returns at once, keeping the count
    assert report.pending == 3
    assert not _drain(read).endswith(b"\n")  # the reader catches up: only the filler was there
    report(4)
    assert report.pending == 0 and _drain(read) == b"7\n"
    report(0)  # nothing pending: nothing written
    assert _drain(read) == b""
