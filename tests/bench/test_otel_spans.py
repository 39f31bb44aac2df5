"""bench.otel_spans times the gateway's real span hooks: sampled, one request records the gateway's five spans in
one frame; unsampled, nothing; and the command prints one line per repeat."""

from __future__ import annotations

import msgspec

from bench.otel_spans import _Buffered, _request, _tracing, main, served_request
from telemetry.otel_gateway import GatewayTrace, spans_of
from telemetry.otel_pipe import FRAME_HEADER


def test_a_sampled_request_records_the_gateways_five_spans_and_an_unsampled_one_nothing():
    finished, record = served_request()
    pipe = _Buffered(keep=True)
    _request(_tracing(1.0, pipe), finished, record)
    trace = spans_of(msgspec.msgpack.decode(bytes(pipe._buf[FRAME_HEADER:]), type=GatewayTrace))
    assert int.from_bytes(pipe._buf[:FRAME_HEADER], "big") == len(pipe._buf) - FRAME_HEADER  # one frame
    assert [s.name for s in trace.spans] == ["admit", "decide", "dispatch", "relay", "chat m"]
    pipe._buf.clear()
    _request(_tracing(0.0, pipe), finished, record)
    assert pipe._buf == b""


def test_one_line_per_repeat(capsys):
    assert main(["--requests", "20", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(len(line.split(" | ")) == 4 for line in lines[1:])
