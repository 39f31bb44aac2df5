"""Pair gates run once for a fleet (``gateway/state.py`` drives them): one replica at a time runs a pair version's
canaries under a lease in the state store (expiry, and a fencing token: only the current holder can write the
verdict), and every replica reads the verdict instead of running it again (``gateway/fleet.py``)."""

from __future__ import annotations

import msgspec

from gateway.fleet_limits import FleetConn
from gateway.gates.values import Verdict

VERDICT_TTL_S = 7 * 24 * 3600

# a gate run's lease: the holder's token when this replica holds it (new or renewed), else 0 and the holder
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then
  if string.sub(cur, 1, string.len(ARGV[1]) + 1) == ARGV[1] .. '#' then
    redis.call('PEXPIRE', KEYS[1], ARGV[2]); return {1, cur}
  end
  return {0, cur}
end
local token = redis.call('INCR', KEYS[2])
local holder = ARGV[1] .. '#' .. token
redis.call('SET', KEYS[1], holder, 'PX', ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return {1, holder}
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]); return 1 end
return 0
"""

# the verdict is written only by the lease's current holder (a fenced write: a stale holder's is refused)
_VERDICT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
redis.call('DEL', KEYS[1])
return 1
"""


class FleetGates:
    """One replica's side of the fleet's gate runs: read a verdict, take and renew the lease, publish (fenced)."""

    def __init__(self, fleet: FleetConn) -> None:
        self.fleet = fleet
        self._acquire = fleet.client.register_script(_ACQUIRE)
        self._renew = fleet.client.register_script(_RENEW)
        self._verdict = fleet.client.register_script(_VERDICT)

    def _keys(self, pool: str, key: str) -> tuple[str, str, str]:
        k = self.fleet.key
        return k("gate", pool, key, "lease"), k("gate", pool, key, "fence"), k("gate", pool, key, "verdict")

    async def verdict(self, pool: str, key: str) -> Verdict | None:
        raw = await self.fleet.bounded(self.fleet.client.get(self._keys(pool, key)[2]))
        return None if raw is None else msgspec.json.decode(raw, type=Verdict)

    async def acquire(self, pool: str, key: str, lease_s: float) -> str | None:
        """This replica's lease on running the pool's canaries (its holder string with the fencing token), or
        None while another replica holds it."""
        lease, fence, _ = self._keys(pool, key)
        ok, holder = await self.fleet.bounded(self._acquire(keys=[lease, fence], args=[
            self.fleet.replica, int(lease_s * 1000), VERDICT_TTL_S * 1000]))
        return holder.decode() if ok else None

    async def renew(self, pool: str, key: str, holder: str, lease_s: float) -> bool:
        lease = self._keys(pool, key)[0]
        return bool(await self.fleet.bounded(self._renew(keys=[lease], args=[holder, int(lease_s * 1000)])))

    async def publish_verdict(self, pool: str, key: str, holder: str, verdict: Verdict) -> bool:
        """Write the verdict if ``holder`` still holds the lease (False: a stale holder, the write refused)."""
        lease, _, stored = self._keys(pool, key)
        return bool(await self.fleet.bounded(self._verdict(keys=[lease, stored], args=[
            holder, msgspec.json.encode(verdict), VERDICT_TTL_S])))
