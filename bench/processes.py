"""Start and always stop real processes (`specgate worker`, `specgate serve`, smg) on free loopback ports.

Used by the benchmarks (``bench.reliability``) and by the integration tests, which import it from here.
Processes run the ``specgate`` console script next to this interpreter, with the repository as cwd.
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STARTUP_TIMEOUT_S = 180  # model load is ~10 s alone; this machine is shared
ADMIN_TOKEN = "test-admin-token"  # $SPECGATE_ADMIN_TOKEN of the gateways started here
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}  # headers of the admin API
MODEL = "SmolLM2-135M-Instruct"  # the served model's name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = STARTUP_TIMEOUT_S, ok=(200,)) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} answered; see its log")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code in ok:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer {ok} within {timeout:.0f} s")


def stop(proc: subprocess.Popen, grace: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def running(argv: list[str], health_url: str, log: Path, ok=(200,), *, timeout: float = STARTUP_TIMEOUT_S,
            env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """``argv`` started with its output in ``log``, once ``health_url`` answers ``ok``; always stopped."""
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            try:
                wait_http(health_url, proc, timeout=timeout, ok=ok)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{log.stem} did not come up: {exc}; see {log}") from exc
            yield proc
        finally:
            stop(proc)


@contextlib.contextmanager
def worker(tmp: Path, *flags: str, calibrate: bool = False, env: dict[str, str] | None = None) -> Iterator[str]:
    """A real `specgate worker`; yields its base URL. ``--no-calibrate`` keeps startup ~10 s, unless
    ``calibrate`` (its start-up step costs are what a test reads). ``env``: added to this process's."""
    port = free_port()
    argv = [str(BIN / "specgate"), "worker", "--port", str(port), *([] if calibrate else ["--no-calibrate"]),
            "--log-level", "warning", *flags]
    with running(argv, f"http://127.0.0.1:{port}/health", tmp / f"worker-{port}.log", env=env):
        yield f"http://127.0.0.1:{port}"


def write_policy(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@contextlib.contextmanager
def gateway(tmp: Path, policy: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A real `specgate serve`; yields its base URL. /health answers once its pools were probed."""
    port = free_port()
    argv = [str(BIN / "specgate"), "serve", "--policy", str(policy), "--port", str(port),
            "--log-console", "--log-level", "warning", *flags]
    with running(argv, f"http://127.0.0.1:{port}/health", tmp / f"gateway-{port}.log",
                 env={"SPECGATE_ADMIN_TOKEN": ADMIN_TOKEN, **(env or {})}):
        yield f"http://127.0.0.1:{port}"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows: the header of every benchmark."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
