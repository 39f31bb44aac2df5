"""A route's concurrency cap held fleet-wide (gateway/fleet_slots.py) against a real valkey-server: the replicas'
grants never add up to more than the cap, a replica short of slots gets the ones another gave back, a dead
replica's slots come free when its grant expires, and with the store down each replica's local cap admits."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.errors import ApiError
from gateway.fleet import Fleet, FleetDown
from gateway.limits import RouteLimiter, limiters_for
from policies.schema import Route, State
from policies.stats import LearningState
from tests.valkey_helpers import ValkeyServer

CAP = 4


def _fleet(url: str) -> Fleet:
    return Fleet(State(url=url, key_prefix="slots", sync_interval_s=0.1, timeout_ms=200.0), Path("."))


async def _replicas(url: str, n: int = 3) -> tuple[list[Fleet], list[RouteLimiter]]:
    """``n`` replicas that know each other (one sync round each, twice), each with a grant of the route's slots."""
    fleets = [_fleet(url) for _ in range(n)]
    for _ in range(2):
        for fleet in fleets:
            await fleet.sync({}, {}, 600.0, {"policy": "p"})
    limiters = [RouteLimiter(Route(name="app", max_concurrency=CAP), fleet=f) for f in fleets]
    for fleet in fleets:
        await fleet.limits.refill()
    return fleets, limiters


def _admit(limiter: RouteLimiter) -> bool:
    try:
        limiter.admit(0)
        return True
    except ApiError as exc:
        assert exc.status == 429 and exc.code == "concurrency_limit", exc.message
        return False


def test_the_fleet_never_has_more_than_the_cap_in_flight(valkey):
    async def scenario():
        fleets, limiters = await _replicas(valkey.url)
        assert [f.limits.slot_shares["app:concurrency:4"].held for f in fleets] == [2, 2, 0]  # fair share: ceil(4 / 3)
        assert fleets[1].view()["slots"] == {"app:concurrency:4": {"held": 2, "in_flight": 0, "others": 2,
                                                                    "live": True}}
        admitted = [_admit(limiters[i % 3]) for i in range(9)]  # round-robin, none finishing
        assert sum(admitted) == CAP and [lim.in_flight for lim in limiters] == [2, 2, 0]
        # the third replica asks for a slot; the other two hold all four
        await fleets[2].limits.refill()
        assert not _admit(limiters[2]) and fleets[2].limits.slot_shares["app:concurrency:4"].others == 4
        # one request ends at the first replica: its slot is its own to reuse, never two replicas'
        limiters[0].finish(0)
        assert not _admit(limiters[2]) and _admit(limiters[0])
        assert sum(lim.in_flight for lim in limiters) == CAP
        # the first replica stops (its requests done): its slots go back at once and the third one takes them
        for _ in range(2):
            limiters[0].finish(0)
        await fleets[0].close()
        await fleets[2].limits.refill()
        assert fleets[2].limits.slot_shares["app:concurrency:4"].held == 2
        assert _admit(limiters[2]) and _admit(limiters[2]) and not _admit(limiters[2])
        assert sum(lim.in_flight for lim in limiters) == CAP
        for fleet in fleets[1:]:
            await fleet.close()
    asyncio.run(scenario())


def test_a_dead_replicas_slots_come_free_when_its_grant_expires(valkey):
    async def scenario():
        fleets, limiters = await _replicas(valkey.url, n=2)
        a, b = fleets
        assert [f.limits.slot_shares["app:concurrency:4"].held for f in fleets] == [2, 2]
        assert all(_admit(limiters[1]) for _ in range(2)) and not _admit(limiters[1])
        await b.limits.refill()  # a still holds its 2: b gets nothing more
        assert b.limits.slot_shares["app:concurrency:4"].held == 2
        # a dies without giving its slots back (no close, no renewal): they free once its grant expires
        await asyncio.sleep(a.limits.slots_ttl_s + 0.5)
        assert not _admit(limiters[1])  # refused: b asks for one more
        await b.limits.refill()
        assert b.limits.slot_shares["app:concurrency:4"].held == 3  # its 2 in flight + the one it was refused
        assert _admit(limiters[1])
        for fleet in fleets:
            await fleet.close()
    asyncio.run(scenario())


def test_with_the_store_down_each_replica_admits_up_to_the_cap_itself(tmp_path):
    async def scenario():
        fleet = _fleet(ValkeyServer(tmp_path).url)  # never started: connection refused
        limiter = RouteLimiter(Route(name="app", max_concurrency=CAP), fleet=fleet)
        with pytest.raises(FleetDown):
            await fleet.sync({}, {}, 600.0, {"policy": "p"})
        assert [_admit(limiter) for _ in range(CAP + 1)] == [True] * CAP + [False]
        await fleet.close()
    asyncio.run(scenario())


def test_a_reload_that_changes_the_cap_stops_renewing_the_old_grant(valkey):
    async def scenario():
        fleets, limiters = await _replicas(valkey.url, n=1)
        fleet = fleets[0]
        new = limiters_for([Route(name="app", max_concurrency=2)], ["app"], {"app": limiters[0]}, fleet=fleet)
        assert set(fleet.limits.slot_shares) == {"app:concurrency:2"} and new["app"].shared_slots is not None
        await fleet.close()
    asyncio.run(scenario())


def test_a_route_without_a_cap_holds_no_slots(valkey):
    """Nothing is asked of the store for a route without ``max_concurrency``."""
    async def scenario():
        fleet = _fleet(valkey.url)
        await fleet.sync(LearningState().tables(), {}, 600.0, {"policy": "p"})
        RouteLimiter(Route(name="free"), fleet=fleet)
        assert fleet.limits.slot_shares == {}
        await fleet.close()
    asyncio.run(scenario())
