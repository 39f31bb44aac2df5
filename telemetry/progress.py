"""Progress of a long command (trace build, calibrate, replay, the benchmarks): a rich bar on a terminal, and
plain lines where nobody watches a terminal (CI logs, ``nohup``, a pipe), at most one every ``every_s`` seconds
plus the last, so a ten-minute run shows it is alive without flooding its log."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, TypeVar

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

T = TypeVar("T")


def _clock_text(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """``with Progress("trace build", total=200) as bar: ... bar.advance()``; ``total=None`` when the count of
    steps is not known up front (a bar that pulses; plain lines without a fraction). ``note`` lines print above
    the bar (or as plain lines)."""

    def __init__(self, description: str, total: int | None, *, stream: IO[str] | None = None,
                 every_s: float = 10.0, clock: Callable[[], float] = time.monotonic, transient: bool = False) -> None:
        self.description, self.total, self.done = description, total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.every_s, self.clock = every_s, clock
        self.started = self.last_line = clock()
        self.printed = 0  # the count the last plain line showed
        self.current: str | None = None
        self.transient = transient  # a terminal's bar is cleared at the end
        self._rich = None
        self._task = None

    def __enter__(self) -> Progress:
        if self.stream.isatty():
            self._rich = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TimeRemainingColumn(),
                                      console=Console(file=self.stream), transient=self.transient)
            self._rich.start()
            self._task = self._rich.add_task(self.description, total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self.done != self.printed:
            self._line()  # where the run ended, if the last line did not show it

    def advance(self, steps: int = 1, description: str | None = None) -> None:
        self.done += steps
        if self._rich is not None:
            self._rich.update(self._task, advance=steps, **({"description": description} if description else {}))
            return
        now = self.clock()
        if description:
            self.current = description
        if self.done == self.total or now - self.last_line >= self.every_s:
            self._line()

    def describe(self, description: str) -> None:
        """What the run is doing now: the bar's label on a terminal, the next plain line's note elsewhere."""
        if self._rich is not None:
            self._rich.update(self._task, description=description)
        self.current = description

    def set_total(self, total: int) -> None:
        """The count of steps, once it is known (a sweep knows it when it starts)."""
        self.total = total
        if self._rich is not None:
            self._rich.update(self._task, total=total)

    def reached(self, done: int, total: int) -> None:
        """A ``progress(done, total)`` callback (replay's sweep reports this way)."""
        if total != self.total:
            self.set_total(total)
        self.advance(done - self.done)

    def note(self, text: str) -> None:
        if self._rich is not None:
            self._rich.console.print(text, highlight=False, markup=False)
        else:
            print(text, file=self.stream, flush=True)

    def _line(self) -> None:
        now = self.clock()
        self.last_line, self.printed = now, self.done
        elapsed = now - self.started
        if self.total:
            left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
            text = (f"{self.description}: {self.done}/{self.total} ({100 * self.done // self.total}%), "
                    f"{_clock_text(elapsed)} elapsed, ~{_clock_text(left)} left")
        else:
            text = f"{self.description}: {self.done} done, {_clock_text(elapsed)} elapsed"
        print(text + (f": {self.current}" if self.current else ""), file=self.stream, flush=True)


def track(items: Iterable[T], description: str, total: int | None = None, **options) -> Iterator[T]:
    """``items`` as they come, advancing the bar once a consumer asks for the next one (so a step counts when
    it is finished, not when it starts)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(description, total, **options) as bar:
        for item in items:
            yield item
            bar.advance()
