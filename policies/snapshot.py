"""An immutable view of everything live that a decision may read: pool health and load, gateway
concurrency, and the learned acceptance/cost statistics (produced by :class:`policies.stats.LearningState`).

Statistics are stored as time-decayed sums referenced to ``t_ref``; reading them at ``now`` multiplies
every sum by ``2 ** (-(now - t_ref) / half_life_s)``. Ratios (acceptance rates, mean times) do not change
under that uniform factor, only sample counts do. ``SnapshotData`` is the JSON form (``specgate policy
explain --stats``, the admin endpoint); :class:`Snapshot` adds read helpers with a private memo.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from policies.accept import AcceptanceSummary
from policies.cost import FitSummary, MeanSummary


class PoolState(msgspec.Struct, frozen=True, kw_only=True):
    """Live state of one pool, filled by the gateway's pool poller. ``pair_verified``: True when the
    workers report the declared pair version, False on mismatch, None when not yet probed. ``gate`` and
    ``ramp``: the pair gates' verdict and the serving gate's shares (None and empty without gates)."""

    healthy: bool
    pair_verified: bool | None = None
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    workers_healthy: int = 0
    # the pair's rollout gate (gateway/gates/): pending | passed | failed | degraded; None: no gate runs
    gate: str | None = None
    # the serving gate's share of this pool's requests per load region ``slice|bucket index``; a region not
    # listed gets ``ramp_default`` (1.0: no ramp)
    ramp: dict[str, float] = {}
    ramp_default: float = 1.0

    def share(self, slice_: str, bucket: int) -> float:
        """The serving gate's share of requests in a load region (1.0: not ramped)."""
        return self.ramp.get(f"{slice_}|{bucket}", self.ramp_default) if self.ramp else self.ramp_default


UNKNOWN_POOL = PoolState(healthy=False, pair_verified=None)


def load_concurrency(in_flight: int, pools: dict[str, PoolState]) -> int:
    """The load a decision is bucketed by: the requests this gateway has in flight plus the one being decided,
    or, when more, the busiest healthy pool's requests per worker (running + waiting, from its workers'
    ``/v1/loads``) plus this one. One gateway in front of its workers sees both alike; several gateways in
    front of the same workers each see a share of the in-flight count, and only the workers see it all."""
    per_worker = [(p.running + p.waiting) // max(1, p.workers_healthy) for p in pools.values() if p.healthy]
    return max(in_flight + 1, max(per_worker, default=0) + 1)


class SnapshotData(msgspec.Struct, frozen=True, kw_only=True):
    """Serializable snapshot. Keys: acceptance ``route|slice|pool|pair_version`` (route ``*`` = all
    routes); tpot ``pool|slice|bucket`` (pool ``none`` = plain decoding anywhere); rounds/draft/verify
    ``pool|bucket``."""

    now: float = 0.0
    concurrency: int = 0
    half_life_s: float = 300.0
    buckets: list[int] = msgspec.field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    pools: dict[str, PoolState] = {}
    acceptance: dict[str, AcceptanceSummary] = {}
    tpot: dict[str, MeanSummary] = {}
    rounds: dict[str, FitSummary] = {}
    draft: dict[str, FitSummary] = {}
    verify: dict[str, FitSummary] = {}


class Snapshot:
    """Read-only helpers over :class:`SnapshotData`. Never mutated after construction (the memo only
    caches pure functions of the data)."""

    __slots__ = ("data", "_memo")

    def __init__(self, data: SnapshotData) -> None:
        self.data = data
        self._memo: dict[Any, Any] = {}

    @property
    def now(self) -> float:
        return self.data.now

    @property
    def concurrency(self) -> int:
        return self.data.concurrency

    def to_json(self) -> bytes:
        return msgspec.json.encode(self.data)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Snapshot:
        return cls(msgspec.json.decode(raw, type=SnapshotData))

    def pool(self, name: str) -> PoolState:
        return self.data.pools.get(name, UNKNOWN_POOL)

    def factor(self, t_ref: float) -> float:
        """Decay weight of sums referenced at ``t_ref``, read at ``now``."""
        return 2.0 ** (-max(0.0, self.data.now - t_ref) / self.data.half_life_s)

    def bucket(self) -> int:
        """Concurrency bucket: index of the first edge >= concurrency (edges 1,2,4,...)."""
        return bisect.bisect_left(self.data.buckets, max(1, self.data.concurrency))

    def acceptance(self, route: str, slice_: str, pool: str, pair_version: str,
                   min_rounds: float) -> tuple[AcceptanceSummary | None, float]:
        """The route's own curve if it has ``min_rounds`` decayed rounds, else all routes' pooled curve.
        Returns (summary, decay factor)."""
        key = (route, slice_, pool, pair_version, min_rounds)
        hit = self._memo.get(key)
        if hit is None:
            hit = (None, 1.0)
            for r in (route, "*"):
                summary = self.data.acceptance.get(f"{r}|{slice_}|{pool}|{pair_version}")
                if summary is not None:
                    f = self.factor(summary.t_ref)
                    hit = (summary, f)
                    if summary.curve_rounds * f >= min_rounds:
                        break
            self._memo[key] = hit
        return hit

    def _buckets_nearest(self) -> Iterator[int]:
        """Bucket indices by distance from the current concurrency's bucket (lower one first on ties)."""
        b = self.bucket()
        yield b
        for d in range(1, len(self.data.buckets) + 1):
            yield b - d
            yield b + d

    def _nearest(self, table: dict[str, Any], prefix: str,
                 accept: Callable[[Any], bool] | None = None) -> tuple[Any, float] | None:
        """Entry for the current concurrency bucket, else the nearest bucket that has one (that ``accept``
        takes, if given)."""
        for cand in self._buckets_nearest():
            entry = table.get(f"{prefix}|{cand}")
            if entry is not None and (accept is None or accept(entry)):
                return entry, self.factor(entry.t_ref)
        return None

    def _nearest_common(self, a: tuple[dict[str, Any], str], b: tuple[dict[str, Any], str],
                        min_evidence: float) -> tuple[Any, Any] | None:
        """Entries of two tables from the SAME bucket: the one nearest the current concurrency where both
        were ever measured with ``min_evidence`` (tokens or rounds, undecayed), else the nearest where both
        exist at all; None if no bucket has both."""
        fallback = None
        for cand in self._buckets_nearest():
            x, y = a[0].get(f"{a[1]}|{cand}"), b[0].get(f"{b[1]}|{cand}")
            if x is not None and y is not None:
                if x.evidence >= min_evidence and y.evidence >= min_evidence:
                    return x, y
                fallback = fallback or (x, y)
        return fallback

    def plain_and(self, slice_: str, kind: str, pool: str, min_evidence: float = 0.0
                  ) -> tuple[MeanSummary | None, Any]:
        """Plain TPOT of ``slice_`` and the pool's ``kind`` entry ("rounds" fit or "tpot" mean), taken
        from one concurrency bucket (a rounds fit of the slice itself when some bucket has ``min_evidence`` of
        it and of plain, else the pool's fit over every slice: plain TPOT is per slice, and a round-time fit
        pooled with shorter contexts made long contexts look cheap to speculate on) when some bucket has both (preferring the nearest where both have
        ``min_evidence``: one request's timing at a new load is not a fit), so that a speedup never divides
        times measured at different loads; otherwise each from its own nearest bucket."""
        key = ("plain_and", slice_, kind, pool, min_evidence)
        hit = self._memo.get(key)
        if hit is None and kind == "rounds":  # the slice's own round time, where measured enough
            own = self._nearest_common((self.data.tpot, f"none|{slice_}"), (self.data.rounds, f"{pool}|{slice_}"),
                                       min_evidence)
            if own is not None and own[0].evidence >= min_evidence and own[1].evidence >= min_evidence:
                hit = self._memo[key] = own
        if hit is None:
            other = (self.data.tpot, f"{pool}|{slice_}") if kind == "tpot" else (getattr(self.data, kind), pool)
            hit = self._nearest_common((self.data.tpot, f"none|{slice_}"), other, min_evidence)
            if hit is None:
                plain = self.tpot("none", slice_)
                mine = self.tpot(pool, slice_) if kind == "tpot" else self.fit(kind, pool)
                hit = (plain[0] if plain else None, mine[0] if mine else None)
            self._memo[key] = hit
        return hit

    def measured_slope(self, pool: str, min_rounds: float) -> FitSummary | None:
        """The pool's round-time fit from the bucket nearest the current concurrency whose slope was
        measured (:meth:`FitSummary.slope_measured`), or None."""
        key = ("measured_slope", pool, min_rounds)
        if key not in self._memo:
            hit = self._nearest(self.data.rounds, pool, lambda fit: fit.slope_measured(min_rounds))
            self._memo[key] = hit[0] if hit else None
        return self._memo[key]

    def plain_evidence(self, slice_: str) -> float:
        """Tokens of plain TPOT ever measured in ``slice_`` in its best-measured bucket (undecayed): plain
        decoding is cold only when no bucket has ``min_rounds`` of them (a new bucket borrows the nearest
        measured speedup, :meth:`plain_and`, and re-measures plain while the call is close, :meth:`plain_nearby`)."""
        return self._plain_tokens(slice_, range(len(self.data.buckets)))

    def plain_nearby(self, slice_: str) -> float:
        """Tokens of plain TPOT ever measured in ``slice_`` in the current concurrency bucket or the two
        next to it (within a factor of two of this concurrency): a request is recorded at its mean
        concurrency over its life, which under open-loop arrivals often falls in a neighbouring bucket of
        the one its decision saw."""
        b = self.bucket()
        return self._plain_tokens(slice_, (b - 1, b, b + 1))

    def rounds_nearby(self, pool: str) -> float:
        """Rounds of ``pool`` ever measured in the current concurrency bucket or the two next to it."""
        b = self.bucket()
        return max((e.evidence for cand in (b - 1, b, b + 1)
                    if (e := self.data.rounds.get(f"{pool}|{cand}")) is not None), default=0.0)

    def _plain_tokens(self, slice_: str, buckets: Any) -> float:
        """Most plain tokens ever measured in ``slice_`` in one of ``buckets`` (indices), memoized."""
        key = ("plain_tokens", slice_, tuple(buckets))
        if key not in self._memo:
            self._memo[key] = max((e.ever_weight for cand in key[2]
                                   if (e := self.data.tpot.get(f"none|{slice_}|{cand}")) is not None), default=0.0)
        return self._memo[key]

    def tpot(self, pool: str, slice_: str) -> tuple[MeanSummary, float] | None:
        key = ("tpot", pool, slice_)
        if key not in self._memo:
            self._memo[key] = self._nearest(self.data.tpot, f"{pool}|{slice_}")
        return self._memo[key]

    def fit(self, kind: str, pool: str) -> tuple[FitSummary, float] | None:
        key = (kind, pool)
        if key not in self._memo:
            self._memo[key] = self._nearest(getattr(self.data, kind), pool)
        return self._memo[key]
