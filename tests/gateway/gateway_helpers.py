"""Helpers shared by the gateway tests: a request body, and a policy whose only pool points at a closed port
(every request that passes admission then ends in a 503)."""

from __future__ import annotations

import socket

MSG = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_policy(tmp_path, routes: str = ""):
    path = tmp_path / "policy.yaml"
    path.write_text(f"""version: 1
{routes}
slices: [{{name: prose}}]
pools: {{plain: {{proposer: none, workers: ["http://127.0.0.1:{closed_port()}"]}}}}
rules: [{{name: plain, then: bypass}}]
""")
    return path
