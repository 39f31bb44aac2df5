"""A fresh worker + gateway per arm, on free loopback ports, always stopped; the worker's peak RSS.

Each arm gets its own gateway (fresh learner). By default all gateways share one worker: the engine
keeps no state across requests that changes speed (no prefix cache; proposers are per sequence), and
the same process times every arm, so the speed difference between two worker processes of the same
configuration (several percent) does not pass for a policy difference. ``--restart worker``
gives each arm its own worker instead. Processes are started with this interpreter (``-c`` into the CLI,
as ``specgate up`` does) so the harness works from any checkout without an installed entry point.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil

from bench.processes import free_port, running

_CLI = "import sys; from cli import main; sys.exit(main())"


class RssSampler:
    """Polls the resident set size of a process and its children; ``take_peak`` returns the peak since
    the previous call (so each load point gets its own) in MiB. A thread, because the event loop that
    sends requests must not stall on /proc reads."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        self._proc = psutil.Process(pid)
        self._interval = interval_s
        self._peak = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _sample(self) -> int:
        procs = [self._proc, *self._proc.children(recursive=True)]
        total = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(psutil.Error):
                rss = self._sample()
                with self._lock:
                    self._peak = max(self._peak, rss)
            self._stop.wait(self._interval)

    def take_peak(self) -> float:
        with contextlib.suppress(psutil.Error):
            rss = self._sample()
            with self._lock:
                self._peak = max(self._peak, rss)
        with self._lock:
            peak, self._peak = self._peak, 0
        return round(peak / 2**20, 1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


def _process(args: list[str], url: str, log: Path, timeout_s: float):  # noqa: ANN202 (a context manager)
    """This interpreter ``-c`` into the CLI with ``args``, up once ``url/health`` answers (``bench.processes``)."""
    return running([sys.executable, "-c", _CLI, *args], f"{url}/health", log, timeout=timeout_s)


@contextlib.contextmanager
def worker(log_dir: Path, flags: list[str], name: str, timeout_s: float = 240) -> Iterator[tuple[str, RssSampler]]:
    """A fresh `specgate worker` on a free port; yields its URL and an RSS sampler of its process."""
    url = f"http://127.0.0.1:{free_port()}"
    args = ["worker", "--port", url.rsplit(":", 1)[1], "--log-level", "warning", *flags]
    with _process(args, url, log_dir / f"worker-{name}.log", timeout_s) as proc:
        rss = RssSampler(proc.pid)
        try:
            yield url, rss
        finally:
            rss.close()


@contextlib.contextmanager
def gateway(policy: Path, log_dir: Path, name: str, timeout_s: float = 240) -> Iterator[str]:
    """A fresh `specgate serve` (fresh learner) on a free port; yields its URL once its pools were probed."""
    url = f"http://127.0.0.1:{free_port()}"
    args = ["serve", "--policy", str(policy), "--port", url.rsplit(":", 1)[1], "--log-console",
            "--log-level", "warning"]
    with _process(args, url, log_dir / f"gateway-{name}.log", timeout_s):
        yield url
