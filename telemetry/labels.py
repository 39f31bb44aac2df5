"""Bounded label values: every label telemetry exports comes from the policy or from a closed set.

A client controls headers, keys and prompts, never labels: a route, slice, pool, rule or worker the
current policy does not name, and a proposer or exploration kind outside the vocabularies the gateway
passes in (``PolicyView.proposers``/``explorations``), a pair gate or gate state outside
``telemetry.metrics.GATES``/``GATE_STATES``, and a load bucket index past the policy's concurrency edges, is
exported as ``other`` (and a record that never reached a pool or rule as ``none``), so the number of series is at most the product of the policy's
names and the closed sets, whatever the traffic. Hot reload swaps the whole ``LabelSets`` value.
"""

from __future__ import annotations

from dataclasses import dataclass

from telemetry.metrics import GATE_STATES, GATES
from telemetry.views import PolicyView

OTHER = "other"
NONE = "none"
# policies.decide uses this rule name when no rule matched
NO_RULE = "(none)"
STATUSES = frozenset({"ok", "client_error", "rate_limited", "upstream_error", "aborted", "unavailable"})
MAX_POSITION = 16  # draft positions exported per position; deeper positions are not broken out


@dataclass(frozen=True, slots=True)
class LabelSets:
    """The allowed values of each label, taken from one policy view."""

    routes: frozenset[str]
    slices: frozenset[str]
    pools: frozenset[str]
    rules: frozenset[str]
    workers: frozenset[str]
    proposers: frozenset[str]
    explorations: frozenset[str]
    buckets: int = 8  # load buckets: one per concurrency edge, and one above the last

    @classmethod
    def from_policy(cls, policy: PolicyView) -> LabelSets:
        return cls(
            routes=frozenset(r.name for r in policy.routes),
            slices=frozenset(policy.slices),
            pools=frozenset(p.name for p in policy.pools),
            rules=frozenset(policy.rules) | {NO_RULE},
            workers=frozenset(url for pool in policy.pools for url in pool.workers),
            proposers=policy.proposers,
            explorations=policy.explorations,
            buckets=len(policy.load_buckets) + 1,
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

    def proposer(self, value: str) -> str:
        return value if value in self.proposers else OTHER

    @staticmethod
    def status(value: str) -> str:
        return value if value in STATUSES else OTHER

    def exploration(self, value: str) -> str:
        return value if value in self.explorations else OTHER

    def bucket(self, index: int) -> str:
        """A load bucket's index (the learner's ``bisect_left`` over the concurrency edges), as a label."""
        return str(index) if 0 <= index < self.buckets else OTHER

    @staticmethod
    def gate(value: str) -> str:
        return value if value in GATES else OTHER

    @staticmethod
    def gate_state(value: str) -> str:
        return value if value in GATE_STATES else OTHER
