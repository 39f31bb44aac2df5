"""The policy version a request runs under, with what the gateway derived from it (keys, limiters, pair
versions): an immutable value, apart from the mutable ``GatewayState`` hub so that the request stages
(``stages.py``) can name it without importing the hub."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.auth import KeyRing
from gateway.limits import RouteLimiter
from policies.schema import Policy


@dataclass(frozen=True, slots=True)
class Active:
    policy: Policy
    version: str
    keys: KeyRing
    wanted_headers: frozenset[str]
    reads_repeat: bool  # some condition looks at prompt_repeat
    limiters: dict[str, RouteLimiter]
    pair_versions: dict[str, str]
