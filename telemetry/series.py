"""The dashboard's in-memory history: fixed-width time buckets of summed counts, bounded in memory.

Each bucket holds additive sums per (route, slice) group, per (route, rule), per pool, and per (route,
slice, load bucket) for the speedup table (:mod:`telemetry.speedup`), so the page
can filter by route and derive every ratio itself (accept length = 1 + accepted / rounds, attainment =
met / (met + missed), goodput = met / bucket width). Older buckets fall off the end: memory is
``buckets * (groups + rules + pools + speed cells)`` small dicts whatever the traffic, and group keys are
already bounded labels (:mod:`telemetry.labels`; load buckets are the learner's few edges).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from telemetry.speedup import SPEED_FIELDS, add

GROUP_FIELDS = ("requests", "ok", "errors", "explored", "slo_met", "slo_missed", "output_tokens", "rounds",
                "accepted", "drafts", "tpot_spec_sum", "tpot_spec_n", "tpot_plain_sum", "tpot_plain_n", "ttft_sum",
                "ttft_n", "resumed")
POOL_FIELDS = ("running", "waiting", "kv_usage", "healthy_workers")


@dataclass(slots=True)
class Bucket:
    start: float
    groups: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    rules: dict[tuple[str, str], int] = field(default_factory=dict)
    pools: dict[str, dict[str, float | None]] = field(default_factory=dict)
    # (route, slice, load bucket's upper edge or None) -> telemetry.speedup.SPEED_FIELDS sums
    speed: dict[tuple[str, str, int | None], dict[str, float]] = field(default_factory=dict)


class History:
    """Ring of ``size`` buckets of ``width_s`` seconds; not thread-safe (one event loop)."""

    def __init__(self, *, width_s: float = 5.0, size: int = 360) -> None:
        self.width_s = width_s
        self.size = size
        self._buckets: deque[Bucket] = deque(maxlen=size)

    def _bucket(self, at: float) -> Bucket | None:
        """The bucket for time ``at``, created (with empty buckets for any gap) when new; None if too old."""
        start = at - at % self.width_s
        if self._buckets and start < self._buckets[0].start:
            return None
        if not self._buckets or start > self._buckets[-1].start:
            last = self._buckets[-1].start if self._buckets else start - self.width_s
            gap = min(round((start - last) / self.width_s), self.size)
            for i in range(gap - 1, -1, -1):
                self._buckets.append(Bucket(start=start - i * self.width_s))
            return self._buckets[-1]
        index = round((start - self._buckets[0].start) / self.width_s)
        return self._buckets[index]

    def add_request(self, at: float, route: str, slice_: str, rule: str, sums: dict[str, float]) -> None:
        bucket = self._bucket(at)
        if bucket is None:
            return
        group = bucket.groups.setdefault((route, slice_), dict.fromkeys(GROUP_FIELDS, 0.0))
        for name, value in sums.items():
            group[name] += value
        bucket.rules[(route, rule)] = bucket.rules.get((route, rule), 0) + 1

    def add_speed(self, at: float, route: str, slice_: str, edge: int | None, sums: dict[str, float]) -> None:
        """One request's speedup sums (:func:`telemetry.speedup.sample`) in its load bucket."""
        bucket = self._bucket(at)
        if bucket is None:
            return
        group = bucket.speed.setdefault((route, slice_, edge), dict.fromkeys(SPEED_FIELDS, 0.0))
        for name, value in sums.items():
            group[name] += value

    def speed_sums(self, now: float) -> tuple[dict[tuple[str, str, int | None], dict[str, float]], float]:
        """The speedup sums over the window the series cover (every bucket kept, up to ``now``), and that
        window's length in seconds."""
        if self._buckets:
            self._bucket(now)
        out: dict[tuple[str, str, int | None], dict[str, float]] = {}
        for bucket in self._buckets:
            add(out, bucket.speed.items())
        return out, len(self._buckets) * self.width_s

    def add_pools(self, at: float, pools: dict[str, dict[str, float | None]]) -> None:
        """The latest pool state in the bucket wins (a gauge, not a sum)."""
        bucket = self._bucket(at)
        if bucket is not None:
            bucket.pools.update(pools)

    def export(self, now: float) -> dict[str, Any]:
        """Column-oriented series: one list per quantity, aligned with ``t`` (bucket starts)."""
        if self._buckets:
            self._bucket(now)  # extend to now so an idle gateway's charts still move
        buckets = list(self._buckets)
        n = len(buckets)
        groups: dict[tuple[str, str], dict[str, list[float]]] = {}
        rules: dict[tuple[str, str], list[int]] = {}
        pools: dict[str, dict[str, list[float | None]]] = {}
        for i, bucket in enumerate(buckets):
            for key, sums in bucket.groups.items():
                cols = groups.setdefault(key, {name: [0.0] * n for name in GROUP_FIELDS})
                for name, value in sums.items():
                    cols[name][i] = value
            for key, count in bucket.rules.items():
                rules.setdefault(key, [0] * n)[i] = count
            for pool, state in bucket.pools.items():
                cols_p = pools.setdefault(pool, {name: [None] * n for name in POOL_FIELDS})
                for name in POOL_FIELDS:
                    cols_p[name][i] = state.get(name)
        return {
            "width_s": self.width_s,
            "t": [b.start for b in buckets],
            "groups": [{"route": r, "slice": s, **cols} for (r, s), cols in sorted(groups.items())],
            "rules": [{"route": r, "rule": rule, "count": counts} for (r, rule), counts in sorted(rules.items())],
            "pools": [{"pool": p, **cols} for p, cols in sorted(pools.items())],
        }
