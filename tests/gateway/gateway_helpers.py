"""Helpers shared by the gateway tests: a request body, a policy whose only pool points at a closed port
(every request that passes admission then ends in a 503), and a real ``Backend`` that never contacts a worker."""

from __future__ import annotations

import socket

from gateway.backend import Backend

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


def offline_backend(policy) -> Backend:
    """A real ``Backend`` for ``policy`` (its pools, the in-flight counts it owns) with every worker healthy and
    never started, so no health check runs; ``client(url)`` is the URL itself, for a test's ``send`` to record."""
    backend = Backend(policy, monitor_interval_s=60, read_timeout_s=60)
    backend.client = lambda url: url  # type: ignore[method-assign]
    for pool in backend.pools.values():
        for worker in pool.workers.values():
            worker.healthy = True
    return backend
