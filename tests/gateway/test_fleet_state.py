"""GatewayState as a fleet member (gateway/state.py + gateway/fleet.py) against a real valkey-server: the setting,
decisions' snapshots holding another replica's evidence, exploration counted fleet-wide, and no fleet at all
without the setting."""

from __future__ import annotations

import asyncio

import pytest

from gateway.settings import GatewaySettings
from gateway.state import GatewayState, fleet_config
from policies.schema import State
from policies.stats import Outcome
from tests.gateway.gateway_helpers import closed_policy


def _state(tmp_path, name: str, url: str | None, section: str = "") -> GatewayState:
    folder = tmp_path / name
    folder.mkdir()
    path = closed_policy(folder)
    if section:
        path.write_text(path.read_text() + section)
    return GatewayState(GatewaySettings(policy_path=str(path), state_url=url))


def _outcome(i: int) -> Outcome:
    return Outcome(route="default", slice="prose", pool="plain", completion_tokens=10, tpot_s=0.01 + i * 1e-4,
                   timestamp=100.0 + i)


def test_without_the_setting_there_is_no_fleet(tmp_path):
    state = _state(tmp_path, "a", None)
    assert state.fleet is None
    state.learn(_outcome(1))
    assert state.snapshot().data.arms == state.learning.snapshot(0, {}, 1).data.arms


def test_the_flag_overrides_the_policys_url_and_keeps_the_rest(monkeypatch):
    section = State(url="valkey://a:1/0", key_prefix="fleet-x", sync_interval_s=1.0)
    assert fleet_config(section, None) is section
    merged = fleet_config(section, "rediss://b:6380/2")
    assert (merged.url, merged.key_prefix, merged.sync_interval_s) == ("rediss://b:6380/2", "fleet-x", 1.0)
    monkeypatch.delenv("SPECGATE_STATE_PASSWORD", raising=False)
    assert fleet_config(None, "valkey://c:6379/0").password_env is None
    monkeypatch.setenv("SPECGATE_STATE_PASSWORD", "pw")
    assert fleet_config(None, "valkey://c:6379/0").password_env == "SPECGATE_STATE_PASSWORD"
    with pytest.raises(ValueError, match="--state"):
        fleet_config(None, "http://not-a-store")


def test_another_replicas_requests_move_this_replicas_serving_ramp(tmp_path, valkey):
    from gateway.gates.values import Sample, Verdict
    from tests.gateway.gateway_helpers import closed_port
    from tests.integration.gateway_processes import policy_text

    text = policy_text([f"http://127.0.0.1:{closed_port()}"], revision="r1") + \
        "gates:\n  serving: {window: 8}\n  collapse: null\n" + \
        f"state: {{url: '{valkey.url}', key_prefix: ramp}}\n"
    states = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "p.yaml").write_text(text)
        states.append(GatewayState(GatewaySettings(policy_path=str(tmp_path / name / "p.yaml"))))
    a, b = states

    async def scenario():
        for state in (a, b):  # both see the pair pass its equivalence gate (the verdict is shared)
            state.gates.sync({"ngram": "k1"}, 0.0, 0.0)
            state.gates.started("ngram")
            state.gates.finished("ngram", "k1", Verdict(passed=True, reason="ok"), 0.0, 0.0)
            await state.sync_fleet()
        for i in range(3):
            a.fleet.observed(Sample(request_id=f"r{i}", route="default", slice="code", bucket=0, pool="ngram",
                                    key="k1", tpot_s=0.01, ttft_s=0.1, slo_met=True))
        await a.sync_fleet()
        await b.sync_fleet()
        (region,) = b.gates.view("ngram", 1.0)["regions"]
        assert (region["slice"], region["window"]["speculative"]) == ("code", 3)  # a's requests, in b's window
        assert a.gates.view("ngram", 1.0)["regions"] == []  # a's own go in locally (GateDriver.observe), not twice
        for state in (a, b):
            await state.fleet.close()
    asyncio.run(scenario())


def test_a_replica_decides_from_the_others_evidence_and_counts_their_explorations(tmp_path, valkey):
    section = f"state: {{url: '{valkey.url}', key_prefix: unit, sync_interval_s: 0.1}}\n"
    a = _state(tmp_path, "a", None, section)
    # the flag's URL over the section's (another key prefix would be another fleet)
    b = _state(tmp_path, "b", valkey.url, "state: {url: 'valkey://127.0.0.1:1/0', key_prefix: unit}\n")
    assert a.fleet is not None and b.fleet is not None

    async def scenario():
        for i in range(5):
            a.learn(_outcome(i))
        a.change_exploring("prose|ngram", +1)
        await a.sync_fleet()
        await b.sync_fleet()
        arms_b = b.snapshot().data.arms
        assert sum(s.ever for s in arms_b.values()) == 5  # a's evidence, in b's decisions
        assert b.exploring == {"prose|ngram": 1}
        b.change_exploring("prose|ngram", +1)
        assert b.exploring == {"prose|ngram": 2}
        b.learn(_outcome(9))
        await b.sync_fleet()
        await a.sync_fleet()
        a._snapshot = None  # the next decision's snapshot
        assert sum(s.ever for s in a.snapshot().data.arms.values()) == 6
        assert a.exploring == {"prose|ngram": 2}
        a.change_exploring("prose|ngram", -1)
        assert a.exploring == {"prose|ngram": 1}
        for state in (a, b):
            await state.fleet.close()
    asyncio.run(scenario())
