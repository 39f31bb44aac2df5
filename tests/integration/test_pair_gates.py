"""The pair gates end to end: real `specgate worker`s with the real model, real gateways, the
official ``openai`` client for user traffic. The worker's fault injection (``--fault-injection``, tests only,
docs/engine.md) makes its speculation lossy or its drafts random on purpose.

Each scenario has its own gateway (its gates start from nothing); the scenarios that do not restart a worker
share one fault-injectable worker and put its mode back to ``off`` when they end.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from bench.processes import BIN, MODEL, free_port, gateway, running, worker, write_policy
from tests.integration.gate_helpers import FAST_EQUIVALENCE, fault, gate, gated_policy, wait_gate
from tests.integration.gateway_processes import CODE

pytestmark = [pytest.mark.integration, pytest.mark.real_model]


def ask(client: openai.OpenAI, content: str = CODE, max_tokens: int = 24, **headers: str):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=max_tokens, temperature=0, messages=[{"role": "user", "content": content}],
        extra_headers=headers or None)
    return raw, raw.parse()


@pytest.fixture(scope="module")
def faulty_worker(tmp_path_factory, prepared_model):
    with worker(tmp_path_factory.mktemp("faulty"), "--fault-injection", "--num-threads", "1",
                "--max-running-requests", "4") as url:
        yield url


@pytest.fixture
def openai_client():
    def make(gw: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{gw}/v1", api_key="unused", max_retries=0, timeout=120)
    return make


def test_a_correct_pair_passes_its_gates_and_then_serves(tmp_path, faulty_worker, prepared_model, openai_client):
    gates = "  equivalence: {max_tokens: 24, sampled: {samples: 16, max_tokens: 3}}\n  serving: null\n"
    policy = write_policy(tmp_path / "p.yaml", gated_policy(faulty_worker, prepared_model.revision, gates=gates))
    with gateway(tmp_path, policy) as gw:
        client = openai_client(gw)
        view = wait_gate(gw, {"passed", "failed"})
        assert view["state"] == "passed", view
        verdict = view["verdict"]
        assert verdict["passed"] and verdict["canaries"] == 4 and verdict["tokens"] > 0
        assert verdict["sampled_p"] is not None and verdict["sampled_positions"] >= 1
        assert verdict["accept_length"] > 1.0  # the canaries copy from their prompts
        assert [e["state"] for e in view["history"]] == ["pending", "passed"]
        raw, reply = ask(client)
        assert raw.headers["x-specgate-pool"] == "ngram" and reply.specgate["proposer"] == "ngram"
        assert reply.specgate["verify_rounds"] > 0
        metrics = httpx.get(f"{gw}/metrics", timeout=10).text
        assert 'specgate_pair_gate_state{pool="ngram",specgate_pair_gate_state="passed"} 1.0' in metrics


def test_a_lossy_worker_fails_equivalence_and_never_serves_a_user_request(tmp_path, faulty_worker, prepared_model,
                                                                          openai_client):
    fault(faulty_worker, "lossy_accept")
    try:
        policy = write_policy(tmp_path / "p.yaml", gated_policy(faulty_worker, prepared_model.revision,
                                                                gates=FAST_EQUIVALENCE))
        with gateway(tmp_path, policy) as gw:
            client = openai_client(gw)
            early = [ask(client)[0] for _ in range(2)]  # while the gate runs: served, but never speculatively
            view = wait_gate(gw, {"passed", "failed"})
            late = [ask(client)[0] for _ in range(2)]
            assert view["state"] == "failed", view
            mismatch = view["verdict"]["mismatch"]
            assert mismatch["canary"].startswith("builtin/") and mismatch["speculative"] != mismatch["plain"]
            assert "differs from plain" in view["reason"]
            for raw in early + late:
                assert raw.status_code == 200 and raw.headers["x-specgate-pool"] == "plain"
                assert raw.parse().specgate["proposer"] == "none"
            assert "pair gate is pending" in early[0].parse().specgate["reason"]  # decide's built-in refusal
            assert late[0].parse().specgate["rule"] == "degraded"  # the policy's rule on failed pools
    finally:
        fault(faulty_worker, "off")


def test_an_acceptance_collapse_mid_run_is_caught_and_bypassed(tmp_path, faulty_worker, prepared_model,
                                                               openai_client):
    gates = FAST_EQUIVALENCE + ("  serving: null\n"
                                "  collapse: {window_rounds: 24, floor: 1.05, min_baseline: 1.1, shift_alpha: null}\n")
    policy = write_policy(tmp_path / "p.yaml", gated_policy(faulty_worker, prepared_model.revision, gates=gates))
    try:
        with gateway(tmp_path, policy) as gw:
            client = openai_client(gw)
            assert wait_gate(gw, {"passed", "failed"})["state"] == "passed"
            before = [ask(client, max_tokens=32)[1] for _ in range(3)]
            assert all(r.specgate["pool"] == "ngram" and r.specgate["accept_length"] > 1.05 for r in before)
            fault(faulty_worker, "random_draft")
            served, degraded_after = [], None
            for i in range(12):
                raw, reply = ask(client, max_tokens=32)
                assert raw.status_code == 200  # no user request fails
                served.append(reply.specgate)
                if gate(gw)["state"] == "degraded":
                    degraded_after = i + 1
                    break
            assert degraded_after is not None and degraded_after <= 3, served  # 24 rounds: 1-3 requests of 32 tokens
            assert all(s["accept_length"] < 1.05 for s in served if s["proposer"] == "ngram")
            view = gate(gw)
            assert view["history"][-1]["gate"] == "collapse" and "floor" in view["history"][-1]["reason"]
            after = ask(client)[1].specgate
            assert after["pool"] == "plain" and after["rule"] == "degraded"
            metrics = httpx.get(f"{gw}/metrics", timeout=10).text
            assert 'specgate_pair_collapse_alerts_total{pool="ngram"} 1.0' in metrics
    finally:
        fault(faulty_worker, "off")


def test_reported_outcome_regressions_hold_the_pair(tmp_path, faulty_worker, prepared_model, openai_client):
    gates = FAST_EQUIVALENCE + "  serving: null\n  outcome: {min_reports: 5, alpha: 0.01, max_drop: 0.02}\n"
    plain_rule = "  - {name: plain-arm, when: {headers: {x-arm: plain}}, then: bypass}\n"
    policy = write_policy(tmp_path / "p.yaml", gated_policy(faulty_worker, prepared_model.revision, gates=gates,
                                                            extra_rules=plain_rule))
    with gateway(tmp_path, policy) as gw:
        client = openai_client(gw)
        assert wait_gate(gw, {"passed", "failed"})["state"] == "passed"

        def report(rid: str, success: bool) -> httpx.Response:
            return httpx.post(f"{gw}/v1/outcomes", json={"request_id": rid, "success": success}, timeout=10)

        assert report("0" * 32, True).status_code == 404
        bad = httpx.post(f"{gw}/v1/outcomes", json={"request_id": "x", "score": 2}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "score"
        for i in range(5):
            spec, _ = ask(client, max_tokens=8)
            plain, _ = ask(client, max_tokens=8, **{"x-arm": "plain"})
            assert spec.headers["x-specgate-pool"] == "ngram" and plain.headers["x-specgate-pool"] == "plain"
            assert report(spec.headers["x-specgate-request-id"], False).status_code == 200
            assert report(plain.headers["x-specgate-request-id"], True).status_code == 200
            if i == 0:
                again = report(spec.headers["x-specgate-request-id"], True)
                assert again.status_code == 409 and again.json()["error"]["code"] == "already_reported"
        view = gate(gw)
        assert view["state"] == "failed" and view["history"][-1]["gate"] == "outcome", view
        assert view["outcomes"]["default"]["speculative"]["success_rate"] == 0.0
        assert view["outcomes"]["default"]["plain"]["success_rate"] == 1.0
        held, reply = ask(client)
        assert held.headers["x-specgate-pool"] == "plain" and reply.specgate["proposer"] == "none"


def _worker_argv(port: int, *flags: str) -> list[str]:
    return [str(BIN / "specgate"), "worker", "--port", str(port), "--no-calibrate", "--log-level", "warning",
            "--num-threads", "1", *flags]


def test_a_worker_restarted_with_another_pair_version_goes_back_through_the_gates(tmp_path, prepared_model,
                                                                                  openai_client):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    policy = write_policy(tmp_path / "p.yaml", gated_policy(url, prepared_model.revision,
                                                            gates=FAST_EQUIVALENCE + "  serving: null\n"))
    with gateway(tmp_path, policy) as gw:
        client = openai_client(gw)
        with running(_worker_argv(port), f"{url}/health", tmp_path / "w1.log"):
            first = wait_gate(gw, {"passed", "failed"})
            assert first["state"] == "passed"
            assert ask(client)[0].headers["x-specgate-pool"] == "ngram"
        # the same target restarted with another n-gram window (acceptance may change): a new pair version
        with running(_worker_argv(port, "--speculative-ngram-max-match-window-size", "6"), f"{url}/health",
                     tmp_path / "w2.log"):
            deadline = time.monotonic() + 120
            while gate(gw)["key"] == first["key"]:
                assert time.monotonic() < deadline, "the new pair version was never seen"
                time.sleep(0.5)
            view = wait_gate(gw, {"passed", "failed"})
            assert view["state"] == "passed" and view["key"] != first["key"]
            changes = [e for e in view["history"] if e["gate"] == "version"]
            assert "pair version changed" in changes[-1]["reason"]
            assert [e["state"] for e in view["history"]][-2:] == ["pending", "passed"]
            assert ask(client)[0].headers["x-specgate-pool"] == "ngram"
