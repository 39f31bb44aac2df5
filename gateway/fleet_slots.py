"""A route's concurrency cap held fleet-wide (``max_concurrency``): the cap's slots are shared out among the live
replicas through the state store, and each replica admits from the slots it holds, so admission never waits for
the store.

Each replica holds a grant of slots per capped route, recorded in one hash per route and cap (field = replica,
value = ``slots:expiry_ms``). A grant is made by a server-side script (``SLOTS_SCRIPT``, the server's clock): it drops
the entries of replicas whose grant expired (a replica that died frees its slots within ``ttl``), then gives the
asking replica ``min(want, cap - the others' slots)``, replacing its own entry. So the grants of live replicas
never add up to more than the cap, and a replica admits a request only while its requests in flight are fewer
than its grant: the fleet never has more than ``cap`` of the route's requests in flight while the store answers.

What a replica asks for (``SlotShare.want``): its fair share, ``ceil(cap / live replicas)``, or, when more, its
requests in flight plus the one it just refused. The first grants partition the cap; a replica that needs more
gets the slots no other replica holds (an expired one's, or what a replica asking less left). A replica grants
itself again when a request is refused, when its fair share changes, and a third of ``ttl`` after its last grant,
all on the fleet's limits loop (``Fleet.limits_loop``), never on the request path.

While the store is unreachable, or before the first grant, the route's local cap admits (each replica then
allows up to ``cap``), as the fleet's rate limits do (``gateway/limits.py``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

# grant ARGV[2] slots (at most) to replica ARGV[1] out of ARGV[3], for ARGV[4] ms; returns {granted, others' slots}
SLOTS_SCRIPT = """
local me, want, cap, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local all = redis.call('HGETALL', KEYS[1])
local others = 0
for i = 1, #all, 2 do
  if all[i] ~= me then
    local v = all[i + 1]
    local sep = string.find(v, ':', 1, true)
    if tonumber(string.sub(v, sep + 1)) <= now then redis.call('HDEL', KEYS[1], all[i])
    else others = others + tonumber(string.sub(v, 1, sep - 1)) end
  end
end
local granted = math.max(0, math.min(want, cap - others))
redis.call('HSET', KEYS[1], me, granted .. ':' .. (now + ttl))
redis.call('PEXPIRE', KEYS[1], ttl * 2)
return {granted, others}
"""


@dataclass
class SlotShare:
    """This replica's grant of one route's fleet-wide concurrency slots, spent locally on the request path."""

    key: str
    cap: int
    held: int = 0  # slots granted to this replica
    # the route's requests in flight here, read from the count's one owner, its RouteLimiter (``gateway/limits.py``)
    in_flight: Callable[[], int] = lambda: 0
    short: bool = False  # a request was refused for want of a slot since the last grant
    others: int = 0  # the other replicas' slots at the last grant
    granted_at: float = 0.0  # monotonic time of the last grant
    asked_fair: int = 0  # the fair share the last grant asked for
    live: bool = False  # granted at least once since the store was last reachable

    def admits(self) -> bool:
        """Whether one more request fits in this replica's slots (else it is marked short, to ask for more)."""
        if self.in_flight() < self.held:
            return True
        self.short = True
        return False

    def want(self, replicas: int) -> int:
        fair = math.ceil(self.cap / max(1, replicas))
        return min(self.cap, max(fair, self.in_flight() + (1 if self.short else 0)))

    def due(self, replicas: int, ttl_s: float, now: float) -> bool:
        """Whether to ask for a grant now: never granted, short, the fair share changed, or a third of the way
        to the grant's expiry."""
        fair = math.ceil(self.cap / max(1, replicas))
        return not self.live or self.short or fair != self.asked_fair or now - self.granted_at >= ttl_s / 3

    def granted(self, slots: int, others: int, replicas: int) -> None:
        self.held, self.others, self.live, self.short = slots, others, True, False
        self.granted_at = time.monotonic()
        self.asked_fair = math.ceil(self.cap / max(1, replicas))

    def lost(self) -> None:
        """The store stopped answering: the grant is no longer known to hold (the local cap admits)."""
        self.live, self.held = False, 0
