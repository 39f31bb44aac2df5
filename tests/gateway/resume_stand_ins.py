"""Two SGLang stand-ins (tests/backends/replay_server.py serving SGLang's recorded completions streams with
``return_token_ids``) behind the real app: the one that answers first drops the connection after two chunks, the
other answers a continuation in full (tests/gateway/test_resume.py, test_resume_tracing.py)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from litestar.testing import TestClient

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.backends.replay_server import ReplayServer, Reply, fixture_bytes

ADMIN = {"Authorization": "Bearer adm"}  # with SPECGATE_ADMIN_TOKEN=adm, as :func:`gateway_in_front` needs


class Background:
    """Replay servers on an event loop of their own thread (the app's TestClient runs on another)."""

    def __init__(self, *servers: ReplayServer) -> None:
        self.servers = servers
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> Background:
        self.thread.start()
        for s in self.servers:
            asyncio.run_coroutine_threadsafe(s.__aenter__(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.servers:
            asyncio.run_coroutine_threadsafe(s.__aexit__(None, None, None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def sglang_stand_in() -> ReplayServer:
    """An SGLang server as the monitor and a completions stream see it: the original request's stream drops
    after two chunks; a continuation (a prompt of token ids) is answered in full."""
    def completions(body: dict[str, Any]) -> Reply:
        if isinstance(body["prompt"], list):
            return Reply.fixture("completion_stream_resumed.sse")
        return Reply.fixture("completion_stream_ids.sse", close_after_events=2)
    return ReplayServer({
        ("GET", "/health"): Reply(), ("GET", "/v1/loads"): Reply(body=fixture_bytes("loads.json")),
        ("GET", "/server_info"): Reply(body=fixture_bytes("server_info.json")),
        ("GET", "/model_info"): Reply(body=fixture_bytes("model_info.json")),
        ("POST", "/v1/completions"): completions,
        ("POST", "/v1/chat/completions"): Reply.fixture("chat_stream.sse", close_after_events=2),
        ("POST", "/abort_request"): Reply(body=b"{}")})


@contextlib.contextmanager
def gateway_in_front(tmp_path: Path, resume: str = "{max_resumes: 1}") -> Iterator[tuple[TestClient, ReplayServer,
                                                                                           ReplayServer]]:
    """(client, a, b): the app with one plain pool of the two stand-ins and ``resume`` as its policy's section,
    once both are healthy. The caller sets SPECGATE_ADMIN_TOKEN=adm (and any OTEL_* variables) first."""
    a, b = sglang_stand_in(), sglang_stand_in()
    with Background(a, b):
        policy = tmp_path / "policy.yaml"
        policy.write_text(f"""version: 1
slices: [{{name: prose}}]
pools: {{plain: {{proposer: none, workers: ["{a.url}", "{b.url}"]}}}}
rules: [{{name: plain, then: bypass}}]
resume: {resume}
""")
        app = create_app(GatewaySettings(policy_path=str(policy), monitor_interval_s=0.2))
        with TestClient(app, timeout=30) as client:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                pools = client.get("/admin/pools", headers=ADMIN).json()
                if all(w["healthy"] for w in pools["plain"]["workers"]):
                    break
                time.sleep(0.1)
            yield client, a, b
