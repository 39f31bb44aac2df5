"""Helpers shared by the pair-gate integration tests (test_pair_gates.py, test_pair_check_cli.py): the gated policy,
the worker's fault injection and waiting for a pool's gate."""

from __future__ import annotations

import time

import httpx

from bench.processes import ADMIN
from tests.integration.gateway_processes import policy_text


def gated_policy(url: str, revision: str, *, gates: str, extra_rules: str = "") -> str:
    """The integration tests' policy (code pinned to the ngram pool at k=4) with a ``gates:`` section and a rule
    bypassing the ngram pool while its gate is failed or degraded."""
    degraded = "  - {name: degraded, when: {pool: ngram, pair_gate: [failed, degraded]}, then: bypass}\n"
    return policy_text([url], revision=revision, extra_rules=degraded + extra_rules) + "gates:\n" + gates


FAST_EQUIVALENCE = "  equivalence: {max_tokens: 24, sampled: null}\n"


def fault(worker_url: str, mode: str) -> None:
    r = httpx.post(f"{worker_url}/specgate/fault", json={"mode": mode}, timeout=10)
    assert r.status_code == 200 and r.json() == {"mode": mode}


def gate(gw: str, pool: str = "ngram") -> dict:
    r = httpx.get(f"{gw}/admin/pools", headers=ADMIN, timeout=10)
    assert r.status_code == 200
    return r.json()[pool]["gate"]


def wait_gate(gw: str, states: set[str], timeout: float = 240.0, pool: str = "ngram") -> dict:
    deadline = time.monotonic() + timeout
    while True:
        view = gate(gw, pool)
        if view["state"] in states and not view["running"]:
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"gate of {pool} never reached {states}: {view}")
        time.sleep(0.5)
