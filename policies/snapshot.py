"""An immutable view of everything live that a decision may read: pool health and load, gateway
concurrency, and the learned acceptance/cost statistics (produced by :class:`policies.stats.LearningState`).

Statistics are stored as time-decayed sums referenced to ``t_ref``; reading them at ``now`` multiplies
every sum by ``2 ** (-(now - t_ref) / half_life_s)``. Ratios (acceptance rates, mean times) do not change
under that uniform factor, only sample counts do. ``SnapshotData`` is the JSON form (``specgate policy
explain --stats``, the admin endpoint); :class:`Snapshot` adds read helpers with a private memo.
"""

from __future__ import annotations

import bisect
from typing import Any

import msgspec

from policies.accept import AcceptanceSummary
from policies.auto import DEFAULT_LOG_TPOT, PLAIN


class ArmSummary(msgspec.Struct, frozen=True, kw_only=True):
    """Decayed count, sum and sum of squares of log TPOT of one option in one context (policies/auto.py)."""

    t_ref: float
    w: float = 0.0
    sy: float = 0.0
    syy: float = 0.0
    ever: float = 0.0  # requests without decay


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
    front of the same workers each see a share of the in-flight count, and only the workers see it all.
    An outcome is filed under the same measure, averaged over the request's life
    (``GatewayState.busy_area``)."""
    return max(in_flight, worker_load(pools)) + 1


def worker_load(pools: dict[str, PoolState]) -> int:
    """The busiest healthy pool's requests per worker (running + waiting), 0 without one."""
    return max(((p.running + p.waiting) // max(1, p.workers_healthy) for p in pools.values() if p.healthy),
               default=0)


class SnapshotData(msgspec.Struct, frozen=True, kw_only=True):
    """Serializable snapshot. Keys: acceptance ``route|slice|pool|pair_version`` (route ``*`` = all
    routes); arms and gaps ``slice|bucket index|repeat band|option`` (option ``none`` or ``pool@k``; gaps:
    log TPOT over the worker's plain estimate, speculative options only)."""

    now: float = 0.0
    concurrency: int = 0
    half_life_s: float = 300.0
    buckets: list[int] = msgspec.field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    pools: dict[str, PoolState] = {}
    acceptance: dict[str, AcceptanceSummary] = {}
    arms: dict[str, ArmSummary] = {}  # ``slice|bucket|band|option`` (policies/auto.py)
    gaps: dict[str, ArmSummary] = {}  # the same keys: paired log speedups over plain (policies/auto.py)


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

    # --- auto's options (policies/auto.py): decayed (weight, sum of log TPOT) per level of the context ---

    def _table(self, table: str) -> dict[str, ArmSummary]:
        return self.data.gaps if table == "gaps" else self.data.arms

    def _arm_index(self, slice_: str, table: str = "arms") -> dict[str, dict[object, list[float]]]:
        """For ``slice_``: option -> {None: sums over the slice, bucket: ..., (bucket, band): ...}, each sums
        ``[w, sy, latest t_ref, requests ever]`` with w and sy decayed to now (``table``: arms or gaps)."""
        key = ("arm_index", slice_, table)
        index = self._memo.get(key)
        if index is None:
            index = self._memo[key] = {}
            prefix = slice_ + "|"
            for name, s in self._table(table).items():
                if not name.startswith(prefix):
                    continue
                _, bucket, band, label = name.split("|", 3)
                f = self.factor(s.t_ref)
                levels = index.setdefault(label, {})
                for level in (None, int(bucket), (int(bucket), int(band))):
                    acc = levels.setdefault(level, [0.0, 0.0, s.t_ref, 0.0])
                    acc[0] += s.w * f
                    acc[1] += s.sy * f
                    acc[2] = max(acc[2], s.t_ref)
                    acc[3] += s.ever
        return index

    def arm_levels(self, slice_: str, bucket: int, band: int, label: str,
                   table: str = "arms") -> tuple[tuple[float, float, float], ...]:
        """(decayed requests, their sum of log TPOT, the same weight as of the level's latest outcome) of
        ``label`` over the slice, the slice's ``bucket`` and the cell. The third undoes the decay since the
        latest outcome: a mean is taken as of the evidence, not pulled toward a prior as time passes."""
        levels = self._arm_index(slice_, table).get(label, {})
        out = []
        for level in (None, bucket, (bucket, band)):
            w, sy, t_ref, _ = levels.get(level, (0.0, 0.0, self.data.now, 0.0))
            out.append((w, sy, self.factor(t_ref)))
        return tuple(out)

    def arm_anchor(self, slice_: str) -> float:
        """The first guess of an option never measured in ``slice_``: plain decoding's mean log TPOT there, else
        every option's there, else every option's anywhere, else auto's default."""
        key = ("arm_anchor", slice_)
        if key not in self._memo:
            index = self._arm_index(slice_)
            plain = index.get(PLAIN, {}).get(None, (0.0, 0.0))[:2]
            every = [sum(v[None][i] for v in index.values()) for i in (0, 1)]
            anywhere = [sum(s.w * self.factor(s.t_ref) for s in self.data.arms.values()),
                        sum(s.sy * self.factor(s.t_ref) for s in self.data.arms.values())]
            self._memo[key] = next((sy / w for w, sy in (plain, every, anywhere) if w > 1e-9), DEFAULT_LOG_TPOT)
        return self._memo[key]

    def arm_spread(self, label: str, prior_var: float, prior_weight: float, table: str = "arms") -> float:
        """The spread s2 of log TPOT between requests of option ``label`` within one context, pooled over its
        contexts in every slice, with a prior ``prior_var`` worth ``prior_weight`` requests."""
        key = ("arm_spread", prior_var, prior_weight, table)
        by_label = self._memo.get(key)
        if by_label is None:
            sums: dict[str, list[float]] = {}
            for name, s in self._table(table).items():
                if s.w > 1.0:
                    f = self.factor(s.t_ref)
                    acc = sums.setdefault(name.split("|", 3)[3], [0.0, 0.0])
                    acc[0] += max(0.0, s.syy - s.sy * s.sy / s.w) * f
                    acc[1] += (s.w - 1.0) * f
            by_label = self._memo[key] = {
                lab: (prior_var * prior_weight + ss) / (prior_weight + dof) for lab, (ss, dof) in sums.items()}
        return by_label.get(label, prior_var)

    def paired(self, label: str) -> bool:
        """Whether option ``label`` has paired evidence in any slice: its worker reports plain's TPOT beside its
        own (policies/auto.py, "Counterfactual evidence for plain")."""
        labels = self._memo.get("paired")
        if labels is None:
            labels = self._memo["paired"] = {name.split("|", 3)[3] for name in self.data.gaps}
        return label in labels

    def arm_ever(self, slice_: str, label: str, cell: tuple[int, int] | None = None, table: str = "arms") -> float:
        """Requests of ``label`` ever measured (undecayed) in ``slice_``, or in its (bucket, band) ``cell``."""
        levels = self._arm_index(slice_, table).get(label, {})
        return levels[cell][3] if cell in levels else 0.0
