"""Per-route admission: request and token rate limits (token buckets) and a concurrency cap.

Token bucket: capacity C, refill r per second; at time t the level is min(C, level + r * (t - t_last)).
A request costing c is admitted when level >= c (then level -= c); otherwise it is refused with
Retry-After = (c - level) / r. Requests cost 1 against ``requests_per_s`` (capacity ``burst``, default
max(1, ceil(rate))). Tokens cost prompt (approximate) + max_tokens against ``tokens_per_min``
(capacity one minute's worth); the unused part of max_tokens is refunded when the request ends.

In a fleet (``gateway/fleet_limits.py``) both buckets live in the state store: a request is admitted from this
replica's reserve, a share of the fleet bucket granted to it off the request path (``fleet_limits.Reserve``), so the fleet admits at
most R x t + burst in all and admission never waits for the store. The concurrency cap is held fleet-wide the same
way: this replica admits while its requests in flight are fewer than the slots it was granted, and the grants of
all replicas never add up to more than the cap (``gateway/fleet_slots.py``). While the store is unreachable, or
before the first grant, the local buckets and cap below admit (each replica then allows up to R and the cap).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.errors import ApiError
from policies.schema import Route

if TYPE_CHECKING:
    from gateway.fleet import Fleet, Reserve
    from gateway.fleet_slots import SlotShare


class TokenBucket:
    def __init__(self, rate_per_s: float, capacity: float, now: float) -> None:
        self.rate = rate_per_s
        self.capacity = capacity
        self.level = capacity
        self.t = now

    def _refill(self, now: float) -> None:
        if now > self.t:
            self.level = min(self.capacity, self.level + self.rate * (now - self.t))
            self.t = now

    def take(self, cost: float, now: float) -> float | None:
        """None when admitted, else seconds until ``cost`` would be available."""
        self._refill(now)
        if self.level >= cost:
            self.level -= cost
            return None
        return (cost - self.level) / self.rate

    def give_back(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)


class RouteLimiter:
    """Admission state of one route; rebuilt only when the route's limits change on reload."""

    def __init__(self, route: Route, clock: Callable[[], float] = time.monotonic, fleet: Fleet | None = None) -> None:
        self.route_name = route.name
        self.config = (route.rate_limit, route.max_concurrency)
        self.clock = clock
        now = clock()
        rl = route.rate_limit
        self.requests = self.tokens = None
        self.shared_requests: Reserve | None = None
        self.shared_tokens: Reserve | None = None
        self.fleet = fleet
        if rl is not None and rl.requests_per_s is not None:
            burst = rl.burst or max(1, math.ceil(rl.requests_per_s))
            self.requests = TokenBucket(rl.requests_per_s, burst, now)
            if fleet is not None:
                self.shared_requests = fleet.limits.reserve(f"{route.name}:requests:{rl.requests_per_s:g}:{burst:g}",
                                                     rl.requests_per_s, burst)
        if rl is not None and rl.tokens_per_min is not None:
            self.tokens = TokenBucket(rl.tokens_per_min / 60.0, rl.tokens_per_min, now)
            if fleet is not None:
                self.shared_tokens = fleet.limits.reserve(f"{route.name}:tokens:{rl.tokens_per_min:g}",
                                                   rl.tokens_per_min / 60.0, rl.tokens_per_min)
        self.max_concurrency = route.max_concurrency
        self.shared_slots: SlotShare | None = None
        if fleet is not None and route.max_concurrency is not None:
            self.shared_slots = fleet.limits.slots(f"{route.name}:concurrency:{route.max_concurrency}",
                                                   route.max_concurrency)
            self.shared_slots.in_flight = lambda: self.in_flight  # this limiter owns the count its grants ask for
        self.in_flight = 0  # the route's requests in flight at this replica (admitted, not finished)
        self.successor: RouteLimiter | None = None  # the limiter a reload with new limits replaced this one by

    def _shared(self) -> bool:
        """Whether admission counts against the fleet's buckets and cap now (the store answers, and granted)."""
        fleet = self.fleet
        return fleet is not None and fleet.up and all(
            r is None or r.live for r in (self.shared_requests, self.shared_tokens, self.shared_slots))

    def admit(self, cost_tokens: int) -> None:
        """Reserve one slot and ``cost_tokens``; ApiError 429 (with Retry-After) when refused.
        Every admitted request must be paired with exactly one ``finish``."""
        name = self.route_name
        shared = self._shared()
        if shared and self.shared_slots is not None:
            if not self.shared_slots.admits():
                assert self.fleet is not None
                self.fleet.limits.wake()  # ask for one more slot, off the request path
                raise ApiError(429, f"route '{name}' has its max_concurrency {self.max_concurrency} in flight across "
                               f"the fleet ({self.in_flight} here, the other replicas hold "
                               f"{self.shared_slots.others}); retry when one finishes", retry_after=1,
                               code="concurrency_limit")
        elif self.max_concurrency is not None and self.in_flight >= self.max_concurrency:
            raise ApiError(429, f"route '{name}' already has {self.in_flight} requests in flight "
                           f"(max_concurrency {self.max_concurrency}); retry when one finishes",
                           retry_after=1, code="concurrency_limit")
        now = self.clock()
        if self.tokens is not None and cost_tokens > self.tokens.capacity:
            raise ApiError(429, f"request needs ~{cost_tokens} tokens (prompt + max_tokens) but route "
                           f"'{name}' allows {self.tokens.capacity:.0f} tokens per minute; lower "
                           "max_tokens or the prompt", code="token_rate_limit", retry_after=60)
        if shared:
            self._admit_shared(cost_tokens)
            self.in_flight += 1
            return
        if self.requests is not None:
            wait = self.requests.take(1, now)
            if wait is not None:
                raise ApiError(429, f"route '{name}' is over its limit of "
                               f"{self.requests.rate:g} requests/s; retry after the Retry-After "
                               "seconds", retry_after=wait, code="request_rate_limit")
        if self.tokens is not None:
            wait = self.tokens.take(cost_tokens, now)
            if wait is not None:
                if self.requests is not None:
                    self.requests.give_back(1, now)
                raise ApiError(429, f"route '{name}' is over its limit of "
                               f"{self.tokens.capacity:.0f} tokens/min; retry after the Retry-After "
                               "seconds", retry_after=wait, code="token_rate_limit")
        self.in_flight += 1

    def _admit_shared(self, cost_tokens: int) -> None:
        """Admission from this replica's reserves of the fleet buckets (no call to the store: a refused
        request wakes the refill, and its Retry-After is the fleet bucket's last answer)."""
        name, fleet = self.route_name, self.fleet
        assert fleet is not None
        requests, tokens = self.shared_requests, self.shared_tokens
        if requests is not None:
            wait = requests.take(1)
            if wait is not None:
                fleet.limits.wake()
                raise ApiError(429, f"route '{name}' is over its limit of {requests.rate:g} requests/s "
                               "(fleet-wide); retry after the Retry-After seconds", retry_after=wait,
                               code="request_rate_limit")
        if tokens is not None:
            wait = tokens.take(cost_tokens)
            if wait is not None:
                if requests is not None:
                    requests.give_back(1)
                fleet.limits.wake()
                raise ApiError(429, f"route '{name}' is over its limit of {tokens.capacity:.0f} tokens/min "
                               "(fleet-wide); retry after the Retry-After seconds", retry_after=wait,
                               code="token_rate_limit")
        if any(r is not None and r.level < r.batch / 2 for r in (requests, tokens)):
            fleet.limits.wake()  # refill before the reserve runs dry

    def finish(self, refund_tokens: int) -> None:
        """End a request admitted here, on the limiter that now counts it: a reload that changed the
        route's limits moved its in-flight count to a new limiter (``limiters_for``)."""
        limiter = self
        while limiter.successor is not None:
            limiter = limiter.successor
        limiter.in_flight = max(0, limiter.in_flight - 1)
        if limiter.shared_tokens is not None and limiter.shared_tokens.live and refund_tokens > 0:
            limiter.shared_tokens.give_back(refund_tokens)
        elif limiter.tokens is not None and refund_tokens > 0:
            limiter.tokens.give_back(refund_tokens, limiter.clock())

    def view(self) -> dict[str, float | int | None]:
        """What it holds now (``/admin/requests``)."""
        now = self.clock()
        level = None
        if self.tokens is not None:
            self.tokens._refill(now)
            level = round(self.tokens.level, 1)
        view: dict[str, float | int | None] = {"in_flight": self.in_flight, "max_concurrency": self.max_concurrency,
                                               "tokens_available": level}
        slots = self.shared_slots
        if slots is not None:  # in a fleet: the slots this replica holds (None until granted, or with the store down)
            view["fleet_slots"] = slots.held if slots.live else None
        return view


def limiters_for(routes: list[Route], names: list[str], old: dict[str, RouteLimiter],
                 fleet: Fleet | None = None) -> dict[str, RouteLimiter]:
    """Limiters for a (re)loaded policy, keeping the state of routes whose limits did not change."""
    by_name = {r.name: r for r in routes}
    out: dict[str, RouteLimiter] = {}
    for name in names:
        route = by_name.get(name) or Route(name=name)
        kept = old.get(name)
        if kept is not None and kept.config == (route.rate_limit, route.max_concurrency) and kept.fleet is fleet:
            out[name] = kept
        else:
            out[name] = RouteLimiter(route, fleet=fleet)
            if kept is not None:  # its requests in flight now count here, and finish here
                out[name].in_flight = kept.in_flight
                kept.successor = out[name]
                if kept.fleet is not None and kept.shared_slots is not None \
                        and kept.shared_slots is not out[name].shared_slots:
                    kept.fleet.limits.drop_slots(kept.shared_slots.key)
    return out
