"""Bounded label values: every label telemetry exports comes from the policy or from a closed set.

A client controls headers, keys and prompts, never labels: a route, slice, pool, rule or worker the
current policy does not name is exported as ``other`` (and a record that never reached a pool or rule
as ``none``), so the number of series is at most the product of the policy's names and the closed
sets below, whatever the traffic. Hot reload swaps the whole ``LabelSets`` value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from policies.decide import EXPLORATIONS
from policies.schema import Policy, Proposer

OTHER = "other"
NONE = "none"
# policies.decide uses this rule name when no rule matched
NO_RULE = "(none)"
STATUSES = frozenset({"ok", "client_error", "rate_limited", "upstream_error", "aborted", "unavailable"})
PROPOSERS = frozenset(get_args(Proposer))
MAX_POSITION = 16  # draft positions exported per position; deeper positions are not broken out


@dataclass(frozen=True, slots=True)
class LabelSets:
    """The allowed values of each label, taken from one policy."""

    routes: frozenset[str]
    slices: frozenset[str]
    pools: frozenset[str]
    rules: frozenset[str]
    workers: frozenset[str]

    @classmethod
    def from_policy(cls, policy: Policy) -> LabelSets:
        return cls(
            routes=frozenset(policy.route_names()),
            slices=frozenset(s.name for s in policy.slices),
            pools=frozenset(policy.pools),
            rules=frozenset(r.name for r in policy.rules) | {NO_RULE},
            workers=frozenset(url for pool in policy.pools.values() for url in pool.workers),
        )

    def route(self, value: str) -> str:
        return value if value in self.routes else OTHER

    def slice(self, value: str) -> str:
        return value if value in self.slices else OTHER

    def pool(self, value: str) -> str:
        if not value:
            return NONE
        return value if value in self.pools else OTHER

    def rule(self, value: str) -> str:
        if not value:
            return NONE
        return value if value in self.rules else OTHER

    def worker(self, value: str) -> str:
        return value if value in self.workers else OTHER

    @staticmethod
    def proposer(value: str) -> str:
        return value if value in PROPOSERS else OTHER

    @staticmethod
    def status(value: str) -> str:
        return value if value in STATUSES else OTHER

    @staticmethod
    def exploration(value: str) -> str:
        return value if value in EXPLORATIONS else OTHER
