"""Route limits held fleet-wide (``gateway/limits.py`` spends them): request and token buckets, and the concurrency
caps (``gateway/fleet_slots.py``), through the fleet's state store (``gateway/fleet.py``).

Each bucket lives in the store as a token bucket refilled with the server's clock by a script (``_GRANT``,
GCRA-like, atomic). A replica admits from a small ``Reserve`` it was granted from that bucket, refilled by
``Fleet.limits_loop`` as soon as one runs short (the request path wakes it) or every 50 ms, so the fleet admits at
most what the bucket grants (R x t + burst) and no request waits for the store. While the store is unreachable
the reserves and slot grants are dropped and each replica admits on its local limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.fleet_slots import SLOTS_SCRIPT, SlotShare


class FleetConn(Protocol):
    """The fleet's connection as its parts (route limits, gate runs) use it: ``gateway.fleet.Fleet``."""

    client: Any  # redis.asyncio.Redis
    replica: str  # this replica's name
    replicas: dict[str, Any]  # the replicas with a live heartbeat
    interval: float  # the sync interval
    up: bool

    def key(self, *parts: str) -> str: ...

    async def bounded(self, coro: Any, calls: int = 1) -> Any: ...

# token bucket with the server's clock: refill, then grant up to ARGV[3] tokens if at least ARGV[4] are there
_GRANT = """
local rate, cap, want, least = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local s = redis.call('HMGET', KEYS[1], 'level', 't')
local level, last = tonumber(s[1]), tonumber(s[2])
if level == nil then level, last = cap, now end
if now > last then level = math.min(cap, level + rate * (now - last)); last = now end
local granted, wait = 0, 0
if level >= least then granted = math.min(want, level); level = level - granted
else wait = (least - level) / rate end
redis.call('HSET', KEYS[1], 'level', tostring(level), 't', tostring(last))
redis.call('PEXPIRE', KEYS[1], math.floor(cap / rate * 1000) + 60000)
return {tostring(granted), tostring(wait)}
"""


@dataclass
class Reserve:
    """A share of one fleet-wide token bucket this replica was granted, spent locally on the request path."""

    key: str
    rate: float
    capacity: float
    batch: float  # how much one grant asks for (and the most this replica holds)
    level: float = 0.0
    want: float = 0.0  # a refused request's cost: the next grant must cover it
    wait_s: float = 0.0  # the fleet bucket's last answer: seconds until ``want`` is there
    asked_at: float = 0.0
    live: bool = False  # granted at least once since the store was last reachable

    def take(self, cost: float) -> float | None:
        """None when admitted from the reserve, else the Retry-After (the fleet's wait, or one refill)."""
        if self.level >= cost:
            self.level -= cost
            return None
        self.want = max(self.want, cost)
        self.batch = min(self.capacity, max(self.batch, cost))  # one grant covers a request this size
        return max(self.wait_s, 0.05)

    def give_back(self, amount: float) -> None:
        self.level = min(max(self.batch, self.level), self.level + amount)


class FleetLimits:
    """One replica's reserves of the fleet buckets and its concurrency grants, refilled off the request path."""

    def __init__(self, fleet: FleetConn) -> None:
        self.fleet = fleet
        self._grant = fleet.client.register_script(_GRANT)
        self._slots = fleet.client.register_script(SLOTS_SCRIPT)
        self.reserves: dict[str, Reserve] = {}
        self.slot_shares: dict[str, SlotShare] = {}  # concurrency caps (gateway/fleet_slots.py)
        self.slots_ttl_s = max(2.0, 4 * fleet.interval)  # a grant's life: a dead replica's slots free after it
        self._wake = asyncio.Event()

    def reserve(self, key: str, rate: float, capacity: float) -> Reserve:
        """The local share of the fleet bucket ``key`` (one per route, kind and limit)."""
        reserve = self.reserves.get(key)
        if reserve is None or (reserve.rate, reserve.capacity) != (rate, capacity):
            batch = min(capacity, max(1.0, rate * min(0.05, self.fleet.interval)))
            reserve = self.reserves[key] = Reserve(key=key, rate=rate, capacity=capacity, batch=batch)
            self._wake.set()
        return reserve

    def slots(self, key: str, cap: int) -> SlotShare:
        """This replica's share of the fleet-wide concurrency cap ``key`` (one per route and cap)."""
        share = self.slot_shares.get(key)
        if share is None:
            share = self.slot_shares[key] = SlotShare(key=key, cap=cap)
            self._wake.set()
        return share

    def drop_slots(self, key: str) -> None:
        """A reload changed the route's cap: stop renewing the old grant (the store forgets it within its ttl)."""
        self.slot_shares.pop(key, None)

    def wake(self) -> None:
        """Refill now (a request was refused, or a reserve runs low)."""
        self._wake.set()

    def lost(self) -> None:
        """The store stopped answering: nothing granted is known to hold (the local limits admit)."""
        for reserve in self.reserves.values():
            reserve.live, reserve.level = False, 0.0
        for share in self.slot_shares.values():
            share.lost()

    def give_back_slots(self, pipe: Any) -> None:
        """Queue on ``pipe`` the removal of this replica's concurrency grants (at shutdown: the others may take
        its slots at once)."""
        fleet = self.fleet
        for share in self.slot_shares.values():
            pipe.hdel(fleet.key("slots", share.key), fleet.replica)

    async def refill(self) -> None:
        """Ask the fleet buckets for what the reserves lack, and renew the concurrency grants that are due (one
        pipelined round for all of them)."""
        fleet = self.fleet
        todo = [r for r in self.reserves.values() if not r.live or r.want > r.level or r.level < r.batch / 2]
        now, replicas = time.monotonic(), max(1, len(fleet.replicas))
        shares = [s for s in self.slot_shares.values() if s.due(replicas, self.slots_ttl_s, now)]
        if not todo and not shares:
            return
        pipe = fleet.client.pipeline(transaction=False)
        for r in todo:
            least = max(r.want - r.level, 0.0)
            want = max(r.batch - r.level, least)
            await self._grant(keys=[fleet.key("rl", r.key)], args=[repr(r.rate), repr(r.capacity), repr(want),
                                                               repr(least)], client=pipe)
        for s in shares:
            await self._slots(keys=[fleet.key("slots", s.key)], args=[
                fleet.replica, s.want(replicas), s.cap, int(self.slots_ttl_s * 1000)], client=pipe)
        answers = await fleet.bounded(pipe.execute())
        for r, (granted, wait) in zip(todo, answers[:len(todo)], strict=True):
            r.level += float(granted)
            r.wait_s = float(wait)
            r.live = True
            if r.level >= r.want:
                r.want = 0.0
        for s, (granted, others) in zip(shares, answers[len(todo):], strict=True):
            s.granted(int(granted), int(others), replicas)

    async def woken(self, at_most_s: float) -> None:
        """Wait until the request path wakes the refill, or ``at_most_s`` (``Fleet.limits_loop``)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(at_most_s):
                await self._wake.wait()
        self._wake.clear()

    def view(self) -> dict[str, dict[str, Any]]:
        """Each capped route's slots here: granted, in flight, and held by the other replicas."""
        return {s.key: {"held": s.held, "in_flight": s.in_flight(), "others": s.others, "live": s.live}
                for s in self.slot_shares.values()}
