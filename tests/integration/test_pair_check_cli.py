"""`specgate pair check` and `POST /admin/pools/NAME/check` against one real fault-injectable worker
(docs/policy.md, "Pair gates"): a correct pair passes, the same worker made lossy fails naming the canary and
the output position; an operator's re-check sends a passed pool back through pending to passed."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from bench.processes import ADMIN, BIN, REPO, gateway, worker, write_policy
from tests.integration.gate_helpers import FAST_EQUIVALENCE, fault, gated_policy, wait_gate

pytestmark = [pytest.mark.integration, pytest.mark.real_model]


@pytest.fixture(scope="module")
def faulty_worker(tmp_path_factory, prepared_model):
    with worker(tmp_path_factory.mktemp("pair-check"), "--fault-injection", "--num-threads", "1") as url:
        yield url


def pair_check(policy) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "specgate"), "pair", "check", "--policy", str(policy), "--pool", "ngram"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_pair_check_passes_a_correct_pair_and_fails_a_lossy_one(tmp_path, faulty_worker, prepared_model):
    policy = write_policy(tmp_path / "p.yaml", gated_policy(faulty_worker, prepared_model.revision,
                                                            gates=FAST_EQUIVALENCE))
    passed = pair_check(policy)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    first = passed.stdout.splitlines()[0]
    assert first.startswith("pool ngram (pair smollm2-ngram@") and "): passed: 4 canaries token-identical to " \
        "plain (" in first, passed.stdout
    assert "4 canaries, " in passed.stdout and f"worker {faulty_worker}" in passed.stdout
    fault(faulty_worker, "lossy_accept")
    try:
        failed = pair_check(policy)
    finally:
        fault(faulty_worker, "off")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "): FAILED: greedy output differs from plain on canary 'builtin/" in failed.stdout, failed.stdout
    assert "at output position " in failed.stdout and "speculative token " in failed.stdout


def test_an_operators_check_sends_a_passed_pool_back_through_pending(tmp_path, faulty_worker, prepared_model):
    policy = write_policy(tmp_path / "p.yaml", gated_policy(faulty_worker, prepared_model.revision,
                                                            gates=FAST_EQUIVALENCE + "  serving: null\n"))
    with gateway(tmp_path, policy) as gw:
        first = wait_gate(gw, {"passed", "failed"})
        assert first["state"] == "passed", first
        r = httpx.post(f"{gw}/admin/pools/ngram/check", headers=ADMIN, timeout=10)
        assert r.status_code == 202, r.text
        assert r.json()["gate"]["state"] == "pending"  # the run starts on this tick: no request sees it passed
        busy = httpx.post(f"{gw}/admin/pools/ngram/check", headers=ADMIN, timeout=10)
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "gate_running"
        plain = httpx.post(f"{gw}/admin/pools/plain/check", headers=ADMIN, timeout=10)
        assert plain.status_code == 404 and plain.json()["error"]["code"] == "no_such_gate"
        again = wait_gate(gw, {"passed", "failed"})
        assert again["state"] == "passed" and again["key"] == first["key"], again
        assert [(e["gate"], e["state"]) for e in again["history"]] == [
            ("version", "pending"), ("equivalence", "passed"), ("equivalence", "pending"), ("equivalence", "passed")]
        assert again["history"][2]["reason"] == "re-check requested by an operator"
