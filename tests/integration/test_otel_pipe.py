"""The gateway's trace export pipe (telemetry/otel_pipe.py) with its real exporter process
(telemetry/otel_export.py) and an OTLP/HTTP receiver decoding the official protobuf messages: frames arrive as
the spans they describe, a pipe closed at once still delivers what it holds, an exporter process that dies is
replaced, one that stops reading never blocks the gateway (traces past the buffer are dropped and counted), and
requests whose spans the collector refuses are counted too."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from bench.processes import free_port
from telemetry.otel_pipe import CLIENT, SERVER, SpanPipe, WireSpan, WireTrace
from tests.integration.otlp_receiver import otlp_receiver

pytestmark = pytest.mark.integration


def _env(endpoint: str) -> dict[str, str]:
    return {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_TRACES_SAMPLER": "always_on"}


def _trace(n: int, padding: int = 0) -> WireTrace:
    """Request ``n``'s trace: a root with a client parent and one dispatch span (``padding`` bytes of attribute)."""
    return WireTrace(n, 1000 + n, 0xC1, 1, "vendor=1", [
        WireSpan("dispatch", 2 * n + 1, 2 * n + 2, CLIENT, 10, 20, {"specgate.attempt": 1}, "refused"),
        WireSpan("chat m", 2 * n + 2, 0, SERVER, 5, 30, {"specgate.n": n, "pad": "x" * padding})])


def _wait(predicate, timeout_s: float = 60.0) -> None:
    """Until ``predicate()`` (a deadline only a hang reaches)."""
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_shipped_traces_arrive_as_their_spans():
    with otlp_receiver() as (endpoint, receiver):
        pipe = SpanPipe("edge-gw", _env(endpoint))
        pipe.start()

        async def serve() -> None:  # on an event loop, as in the gateway: the flush timer writes the frames
            for n in range(1, 4):
                pipe.ship(_trace(n))
            await asyncio.to_thread(_wait, lambda: len(receiver.spans) == 6)

        asyncio.run(serve())
        assert len(receiver.spans) == 6  # before the pipe closed
        pipe.close()
    spans = {(s.trace_id, s.name): s for s in receiver.spans}
    root, dispatch = spans[(f"{2:016x}{1002:016x}", "chat m")], spans[(f"{2:016x}{1002:016x}", "dispatch")]
    assert (root.service, root.kind, root.parent_span_id, root.span_id) == ("edge-gw", 2, f"{0xC1:016x}", f"{6:016x}")
    assert (root.start_ns, root.end_ns, root.attributes) == (5, 30, {"specgate.n": 2, "pad": ""})
    assert (dispatch.kind, dispatch.parent_span_id, dispatch.status_code) == (3, root.span_id, 2)
    assert (pipe.dropped, pipe.restarts) == (0, 0)


def test_a_pipe_closed_at_once_delivers_what_it_holds():
    with otlp_receiver() as (endpoint, receiver):
        pipe = SpanPipe("edge-gw", _env(endpoint))
        pipe.start()
        for n in range(50):  # no event loop, under FLUSH_BYTES: nothing is written before close
            pipe.ship(_trace(n))
        pipe.close()
        assert pipe.process is None  # the exporter process exported and exited
        assert len(receiver.spans) == 100 and receiver.posts >= 1


def test_an_exporter_process_that_dies_is_replaced():
    with otlp_receiver() as (endpoint, receiver):
        drops: list[tuple[int, str]] = []
        pipe = SpanPipe("edge-gw", _env(endpoint), restart_s=0.0, on_drop=lambda n, why: drops.append((n, why)))
        pipe.start()
        first = pipe.process
        first.kill()
        first.wait()
        pipe.ship(_trace(1))
        pipe.flush()  # finds it gone: the frame is lost with it, and another process starts
        assert (pipe.dropped, pipe.restarts, drops) == (1, 1, [(1, "exporter_gone")]) and pipe.process is not first
        pipe.ship(_trace(2))
        pipe.close()
    assert {s.attributes["specgate.n"] for s in receiver.spans if s.name == "chat m"} == {2}


def test_an_exporter_that_stops_reading_never_blocks_the_gateway():
    with otlp_receiver() as (endpoint, receiver):
        drops: list[tuple[int, str]] = []
        pipe = SpanPipe("edge-gw", _env(endpoint), max_buffer=256 * 1024, on_drop=lambda n, why: drops.append((n, why)))
        pipe.start()
        os.kill(pipe.process.pid, signal.SIGSTOP)  # reads nothing: the OS pipe fills, then the buffer
        shipped = 200
        for n in range(shipped):  # 200 x 8 KiB: more than the OS pipe (64 KiB) and the buffer together
            pipe.ship(_trace(n, padding=8192))
        assert 0 < pipe.dropped < shipped  # returned, every time, having dropped what did not fit
        assert drops == [(1, "buffer_full")] * pipe.dropped  # the gateway's metric counts each one
        os.kill(pipe.process.pid, signal.SIGCONT)
        pipe.close()
        kept = {s.attributes["specgate.n"] for s in receiver.spans if s.name == "chat m"}
    assert len(kept) == shipped - pipe.dropped and kept == set(range(len(kept)))  # the first ones, whole


def test_a_stuck_exporter_cannot_hold_the_gateways_shutdown():
    """The exporter reads nothing (stopped) and the buffer holds more than the OS pipe takes: close gives up at
    its deadline, counts what it could not write, and kills the exporter."""
    with otlp_receiver() as (endpoint, _):
        drops: list[tuple[int, str]] = []
        pipe = SpanPipe("edge-gw", _env(endpoint), on_drop=lambda n, why: drops.append((n, why)))
        pipe.start()
        process = pipe.process
        os.kill(process.pid, signal.SIGSTOP)
        for n in range(40):  # 40 x 8 KiB: past the OS pipe's 64 KiB, within the buffer
            pipe.ship(_trace(n, padding=8192))
        assert pipe.dropped == 0
        pending = len(pipe._frames)  # not wholly in the OS pipe: the first of them partly, the rest not at all
        assert 30 < pending < 40
        pipe.close(timeout_s=0.5)
        assert pipe.process is None and process.poll() is not None  # killed (a stopped process still dies of it)
        assert drops == [(pending, "shutdown")]


def _failing_sends(service: str, env: dict[str, str], traces: int) -> tuple[SpanPipe, list[tuple[int, str]]]:
    """A started pipe whose exporter's sends all fail, ``traces`` shipped and reported lost; (pipe, drops)."""
    drops: list[tuple[int, str]] = []
    pipe = SpanPipe(service, env, on_drop=lambda n, why: drops.append((n, why)))
    pipe.start()

    async def serve() -> None:
        for n in range(traces):
            pipe.ship(_trace(n))
        await asyncio.to_thread(_wait, lambda: (pipe.collect(), pipe.dropped)[1] == traces)

    asyncio.run(serve())
    return pipe, drops


def test_requests_whose_spans_the_collector_refuses_are_counted():
    """A collector answering 404 (a wrong endpoint path): the exporter's sends fail, and the pipe counts every
    request they held as ``export_failed``, including the last send's, made as the pipe closes."""
    with otlp_receiver() as (endpoint, receiver):
        env = {**_env(endpoint), "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint + "/v1/nothing-here"}
        pipe, drops = _failing_sends("edge-gw", env, 3)
        assert (pipe.dropped, sum(n for n, _ in drops), {why for _, why in drops}) == (3, 3, {"export_failed"})
        pipe.ship(_trace(3))
        pipe.close()
        assert (pipe.dropped, drops[-1]) == (4, (1, "export_failed")) and receiver.spans == []


def test_requests_whose_spans_no_collector_takes_are_counted():
    """Nothing listens at the endpoint (a collector that is down): every connection is refused, the exporter's
    client retries until its timeout, and the requests the failed send held are counted as ``export_failed``."""
    env = {**_env(f"http://127.0.0.1:{free_port()}"), "OTEL_EXPORTER_OTLP_TIMEOUT": "1"}
    pipe, drops = _failing_sends("down-gw", env, 2)
    pipe.close()
    assert (pipe.dropped, {why for _, why in drops}) == (2, {"export_failed"})


def test_the_exporter_process_is_the_gateways_own_whatever_directory_it_was_started_from(tmp_path, monkeypatch):
    """``python -m`` puts its working directory first on the import path: a gateway started from a directory
    holding another ``telemetry`` package (another checkout) must still run its own exporter."""
    impostor = tmp_path / "telemetry"
    impostor.mkdir()
    (impostor / "__init__.py").write_text("")
    (impostor / "otel_export.py").write_text(f"open({str(tmp_path / 'impostor-ran')!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    with otlp_receiver() as (endpoint, receiver):
        pipe = SpanPipe("edge-gw", _env(endpoint))
        pipe.start()
        pipe.ship(_trace(1))
        pipe.close()
    assert not (tmp_path / "impostor-ran").exists()
    assert len(receiver.spans) == 2  # the real exporter sent them
