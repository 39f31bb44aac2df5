"""bench.otel_spans times the gateway's real span hooks: sampled, one request builds the gateway's five spans;
unsampled, none; and the command prints one line per repeat."""

from __future__ import annotations

from bench.otel_spans import _finished, _request, _tracing, main


def test_a_sampled_request_builds_the_gateways_five_spans_and_an_unsampled_one_none():
    finished, record = _finished()
    kept: list = []
    _request(_tracing(1.0, kept), finished, record)
    assert [s.name for s in kept] == ["admit", "decide", "dispatch", "relay", "chat m"]
    kept.clear()
    _request(_tracing(0.0, kept), finished, record)
    assert kept == []


def test_one_line_per_repeat(capsys):
    assert main(["--requests", "20", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(len(line.split(" | ")) == 3 for line in lines[1:])
