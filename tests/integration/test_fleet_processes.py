"""`specgate serve --processes N`: N real gateway processes on one port, made one fleet by a real valkey-server;
refused without the fleet state (N separate gateways would each keep their own)."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest

from bench.processes import ADMIN, ADMIN_TOKEN, BIN, REPO, free_port, running, write_policy
from tests.valkey_helpers import ValkeyServer

pytestmark = pytest.mark.integration

POLICY = """version: 1
slices: [{name: prose}]
pools: {plain: {proposer: none, workers: ["http://127.0.0.1:9"]}}
rules: [{name: plain, then: bypass}]
"""


def test_two_processes_serve_one_port_as_one_fleet(tmp_path):
    store = ValkeyServer(tmp_path).start()
    try:
        policy = write_policy(tmp_path / "p.yaml", POLICY)
        port = free_port()
        argv = [str(BIN / "specgate"), "serve", "--policy", str(policy), "--port", str(port), "--log-level",
                "warning", "--state", store.url, "--processes", "2"]
        with running(argv, f"http://127.0.0.1:{port}/health", tmp_path / "gw.log",
                     env={"SPECGATE_ADMIN_TOKEN": ADMIN_TOKEN}):
            answered, heartbeats = set(), 0
            deadline = time.monotonic() + 30  # heartbeats are read once per sync round (0.5 s); a fast loop outruns them
            while time.monotonic() < deadline:
                r = httpx.get(f"http://127.0.0.1:{port}/admin/fleet", headers=ADMIN, timeout=10)
                assert "server" not in r.headers and "date" in r.headers  # cli/serve.UVICORN in every process
                view = r.json()
                answered.add(view["replica"])
                heartbeats = len(view["replicas"])
                if len(answered) == 2 and heartbeats == 2:
                    break
                time.sleep(0.05)
            assert len(answered) == 2 and heartbeats == 2  # two processes answer, each sees both
    finally:
        store.kill()


def test_processes_without_the_fleet_state_are_refused(tmp_path):
    policy = write_policy(tmp_path / "p.yaml", POLICY)
    done = subprocess.run([str(BIN / "specgate"), "serve", "--policy", str(policy), "--processes", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--processes needs the fleet state" in done.stderr
