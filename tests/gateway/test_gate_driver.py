"""The pair gates' driver in a gateway (gateway/gates/driver.py): a verdict reaches the very next decision, not
a snapshot age later, a finished request feeds the gate of the pool that served it, and only the pools the rules
serve are checked (first), unless an operator asks."""

from __future__ import annotations

import asyncio

import msgspec

from bench.serve.arms import DEFAULT_POLICY
from gateway.gates.driver import UNSERVED
from gateway.gates.values import Verdict
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from policies.compiled import served_pools
from policies.schema import PoolAction
from telemetry.record import RequestRecord
from tests.gateway.gateway_helpers import closed_port
from tests.integration.gateway_processes import policy_text


def _gated_state(tmp_path, gates: str = "gates:\n  serving: {window: 8}\n  collapse: null\n") -> GatewayState:
    path = tmp_path / "p.yaml"
    path.write_text(policy_text([f"http://127.0.0.1:{closed_port()}"], revision="r1") + gates)
    # a snapshot may be an hour old: only the driver's change notice can rebuild it
    return GatewayState(GatewaySettings(policy_path=str(path), snapshot_max_age_s=3600.0))


def _record() -> RequestRecord:
    """A request the ngram pool served well, at concurrency 1."""
    return RequestRecord(request_id="r1", route="default", slice="code", pool="ngram", proposer="ngram",
                         rule="learned", status="ok", http_status=200, concurrency=1, tpot_s=0.01, ttft_s=0.1,
                         slo_met=True)


def test_a_verdict_reaches_the_next_decision_without_waiting_for_the_snapshot_age(tmp_path):
    state = _gated_state(tmp_path)
    state.gates.sync({"ngram": "k1"}, 0.0, 0.0)
    state.gate_runs.publish(0.0)
    assert state.snapshot().data.pools["ngram"].gate == "pending"
    state.gates.started("ngram")
    state.gates.finished("ngram", "k1", Verdict(passed=True, reason="ok"), 0.0, 0.0)
    assert state.snapshot().data.pools["ngram"].gate == "pending"  # not published yet: the old snapshot
    state.gate_runs.publish(0.0)
    assert state.snapshot().data.pools["ngram"].gate == "passed"


def test_a_finished_request_feeds_the_serving_window_of_the_pool_that_served_it(tmp_path):
    state = _gated_state(tmp_path)
    state.gates.sync({"ngram": "k1"}, 0.0, 0.0)
    state.gates.started("ngram")
    state.gates.finished("ngram", "k1", Verdict(passed=True, reason="ok"), 0.0, 0.0)
    state.gate_runs.observe(_record())
    (region,) = state.gates.view("ngram", 1.0)["regions"]
    assert (region["slice"], region["window"]["speculative"]) == ("code", 1)


def test_without_gates_a_finished_request_is_not_kept(tmp_path):
    state = _gated_state(tmp_path, gates="")
    state.gate_runs.observe(_record())
    assert state.gates.pools == {} and state.gates.view("ngram", 1.0) is None


def test_the_pools_the_rules_serve_are_checked_first_in_the_order_the_rules_name_them(tmp_path):
    # the shipped default: its one learned rule serves hybrid, listed third of four speculative pools
    path = tmp_path / "default.yaml"
    path.write_text(DEFAULT_POLICY.read_text())
    state = GatewayState(GatewaySettings(policy_path=str(path)))
    assert served_pools(state.active.policy) == ["hybrid"]
    state.gates.sync({"ngram": "k1", "ngram-adaptive": "k2", "hybrid": "k3", "draft": "k4"}, 0.0, 0.0)
    assert state.gate_runs.due(0.0) == ["hybrid"]
    # the others wait, pending, and say why
    assert [(p, g["state"], g["reason"]) for p in ("ngram", "draft") for g in [state.gates.view(p, 0.0)]] == [
        (p, "pending", UNSERVED.format(pool=p)) for p in ("ngram", "draft")]


def test_an_operators_recheck_runs_a_pool_no_rule_serves(tmp_path):
    path = tmp_path / "default.yaml"
    path.write_text(DEFAULT_POLICY.read_text())
    state = GatewayState(GatewaySettings(policy_path=str(path)))

    async def scenario():
        state.gates.sync({"ngram": "k1", "hybrid": "k3"}, 0.0, 0.0)
        assert state.gate_runs.recheck("ngram", 0.0, 0.0)
        assert [p for p in ("ngram", "hybrid") if state.gates.view(p, 0.0)["running"]] == ["ngram", "hybrid"]
        assert not state.gate_runs.recheck("ngram", 0.0, 0.0)  # running: 409 in the admin API
        for task in list(state.background):
            task.cancel()
    asyncio.run(scenario())


def test_auto_names_every_speculative_pool_and_a_pinned_pool_comes_in_its_rules_order(tmp_path):
    state = _gated_state(tmp_path)  # rules: code-ngram pins ngram, learned is auto
    assert served_pools(state.active.policy) == ["ngram"]
    policy = msgspec.structs.replace(state.active.policy, rules=state.active.policy.rules[-1:])  # auto alone
    assert served_pools(policy) == ["ngram"]
    bypass_only = msgspec.structs.replace(policy, rules=state.active.policy.rules[:1])
    assert served_pools(bypass_only) == []


def test_a_reload_whose_rules_serve_a_waiting_pool_makes_its_gate_due(tmp_path):
    path = tmp_path / "default.yaml"
    path.write_text(DEFAULT_POLICY.read_text())
    state = GatewayState(GatewaySettings(policy_path=str(path)))
    state.gates.sync({"ngram": "k1", "hybrid": "k3"}, 0.0, 0.0)
    assert state.gate_runs.due(0.0) == ["hybrid"]
    policy = state.active.policy
    rules = [*policy.rules[:-1], msgspec.structs.replace(policy.rules[-1], then=PoolAction(pools=["ngram", "hybrid"]))]
    state.apply_policy(msgspec.structs.replace(policy, rules=rules), "v2")
    assert state.gate_runs.due(0.0) == ["ngram", "hybrid"]
