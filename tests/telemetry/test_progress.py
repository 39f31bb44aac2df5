"""A long command's progress: plain lines off a terminal (a CI log, nohup), a rich bar on one."""

from __future__ import annotations

import io

from telemetry.progress import Progress, track


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_line_every_interval_and_the_last():
    out, clock = io.StringIO(), Clock()
    with Progress("trace build", 10, stream=out, every_s=10.0, clock=clock) as bar:
        for step in range(10):
            clock.now += 3.0
            bar.advance(description=f"request {step}")
    assert out.getvalue().splitlines() == [
        "trace build: 4/10 (40%), 12s elapsed, ~18s left: request 3",
        "trace build: 8/10 (80%), 24s elapsed, ~6s left: request 7",
        "trace build: 10/10 (100%), 30s elapsed, ~0s left: request 9",
    ]


def test_a_run_of_unknown_length_prints_where_it_ended_and_notes_as_they_come():
    out, clock = io.StringIO(), Clock()
    with Progress("calibrate: stages measured", None, stream=out, clock=clock) as bar:
        bar.note("  forwards at context 64: 1 30.0 ms")
        clock.now += 61.0
        bar.advance()
        bar.advance()
    assert out.getvalue().splitlines() == [
        "  forwards at context 64: 1 30.0 ms",
        "calibrate: stages measured: 1 done, 1m01s elapsed",
        "calibrate: stages measured: 2 done, 1m01s elapsed",
    ]


def test_track_counts_an_item_once_the_next_is_asked_for():
    out, clock = io.StringIO(), Clock()
    seen = []
    for item in track(["a", "b", "c"], "replay", stream=out, clock=clock, every_s=1e9):
        seen.append(item)
        clock.now += 1.0
    assert seen == ["a", "b", "c"]
    assert out.getvalue().splitlines() == ["replay: 3/3 (100%), 3s elapsed, ~0s left"]


def test_on_a_terminal_a_bar_with_the_count():
    out = Terminal()
    with Progress("serve bench", 4, stream=out) as bar:
        bar.advance(3)
        bar.describe("code ngram-k4")
        bar.note("a line above the bar")
    text = out.getvalue()
    assert "a line above the bar" in text and "code ngram-k4" in text and "3/4" in text
    assert "(75%)" not in text  # the plain line's form is not used on a terminal


def test_a_sweeps_done_of_total_callback_moves_the_count_to_where_it_reports():
    out, clock = io.StringIO(), Clock()
    with Progress("replay runs", None, stream=out, clock=clock, every_s=1e9) as bar:
        for done in (1, 2, 4):  # a process pool may report two jobs at once
            bar.reached(done, 4)
    assert bar.done == 4 and out.getvalue().splitlines() == ["replay runs: 4/4 (100%), 0s elapsed, ~0s left"]
