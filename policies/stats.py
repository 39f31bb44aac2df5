"""The learner: the one object with memory (STYLE #7). It turns request outcomes into time-decayed sums
and hands out immutable snapshots; decisions never read it directly.

Update formulas (for every sum S kept under a key, with half-life H seconds):

    on an outcome at time t >= t_ref:  S <- S * 2^(-(t - t_ref) / H) + x;  t_ref <- t
    on a late outcome (t < t_ref):     S <- S + x * 2^(-(t_ref - t) / H)

Keys and what x is:

- acceptance ``route|slice|pool|pair_version`` and ``*|slice|pool|pair_version``: requests += 1,
  rounds += verify_ct, tokens += completion_tokens, and per draft position j: reached_j, accepted_j
  (given directly, or from the accepted-drafts histogram, see :mod:`policies.accept`); curve_rounds +=
  rounds that carried such data. A new pair version is a new key, so its statistics start from the prior.
- tpot ``pool|slice|bucket`` (``none|slice|bucket`` for any request served without speculation): weight
  += completion_tokens - 1, total += tpot_s * (completion_tokens - 1) (a token-weighted mean TPOT).
- rounds/draft/verify ``pool|bucket``: a weighted line fit of seconds per round against k, weight =
  verify_ct (:mod:`policies.cost`), plus rounds per k without decay (whether the slope is trusted); rounds
  also per slice, ``pool|slice|bucket``: a round over a long context costs more, as plain TPOT of that slice
  does, and a speedup divides the two (:meth:`Snapshot.plain_and`).

Each key also keeps its sums without decay (``ever_*``): how much evidence was ever seen, which decides
whether a candidate has been measured at all (cold) as opposed to measured long ago (stale).

Failed outcomes (ok False) only count in ``failures``. Works from per-request totals alone (SGLang):
then the acceptance curve stays at the prior and auto uses the measured TPOT instead.
"""

from __future__ import annotations

import bisect

import msgspec

from policies.accept import AcceptanceSummary, counts_from_histogram
from policies.cost import FitSummary, MeanSummary
from policies.schema import Learning
from policies.snapshot import PoolState, Snapshot, SnapshotData


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    """What came back from one request. ``draft_tokens`` = k requested (0 = no speculation);
    ``reached_per_position[j]`` = rounds where draft position j+1 was proposed with all earlier drafts
    accepted; ``draft_s``/``verify_s`` = total seconds spent drafting/verifying."""

    route: str
    slice: str
    pool: str
    pair_version: str = ""
    proposer: str = "none"
    draft_tokens: int = 0
    completion_tokens: int = 0
    verify_ct: int = 0
    correct_drafts_histogram: list[int] = []
    accepted_per_position: list[int] | None = None
    reached_per_position: list[int] | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    concurrency: int = 1
    ok: bool = True
    status: int = 200
    draft_s: float | None = None
    verify_s: float | None = None
    timestamp: float = 0.0


class _Sums:
    """Mutable decayed sums: ``head`` fixed-size, ``a``/``b`` growable per-position lists."""

    __slots__ = ("t_ref", "head", "a", "b", "ever", "ever_by_k")

    def __init__(self, t: float, size: int) -> None:
        self.t_ref, self.head, self.a, self.b = t, [0.0] * size, [], []
        self.ever = [0.0] * size  # ``head`` without decay: how much evidence was ever seen
        self.ever_by_k: dict[int, float] = {}  # fits: rounds without decay per draft length

    def weight(self, t: float, half_life: float) -> float:
        """Decay the sums to ``t`` if later and return the weight a new observation at ``t`` gets."""
        if t >= self.t_ref:
            f = 2.0 ** (-(t - self.t_ref) / half_life)
            if f != 1.0:
                self.head = [v * f for v in self.head]
                self.a = [v * f for v in self.a]
                self.b = [v * f for v in self.b]
            self.t_ref = t
            return 1.0
        return 2.0 ** (-(self.t_ref - t) / half_life)

    def add_positions(self, reached: list[int], accepted: list[int], w: float) -> None:
        for target, values in ((self.a, reached), (self.b, accepted)):
            target.extend([0.0] * (len(values) - len(target)))
            for j, v in enumerate(values):
                target[j] += w * v


class LearningState:
    """Rolling acceptance and cost statistics (formulas in the module docstring)."""

    def __init__(self, learning: Learning | None = None) -> None:
        self.learning = learning or Learning()
        self.failures = 0
        self._sums: dict[tuple[str, str], _Sums] = {}
        self._frozen: dict[str, dict[str, msgspec.Struct]] = {
            "acceptance": {}, "tpot": {}, "rounds": {}, "draft": {}, "verify": {}}

    def configure(self, learning: Learning) -> None:
        """Adopt a reloaded policy's learning settings; statistics are kept."""
        self.learning = learning

    def _bucket(self, concurrency: int) -> int:
        return bisect.bisect_left(self.learning.concurrency_buckets, max(1, concurrency))

    def _sums_for(self, table: str, key: str, t: float, size: int) -> tuple[_Sums, float]:
        sums = self._sums.get((table, key))
        if sums is None:
            sums = self._sums[(table, key)] = _Sums(t, size)
        return sums, sums.weight(t, self.learning.half_life_s)

    def record(self, outcome: Outcome) -> None:
        """Fold one outcome into the sums and refresh the frozen summaries of the keys it touched."""
        o = outcome
        if not o.ok:
            self.failures += 1
            return
        t, bucket = o.timestamp, self._bucket(o.concurrency)
        speculative = o.proposer != "none" and o.draft_tokens > 0
        if o.tpot_s is not None and o.completion_tokens >= 2:
            n = o.completion_tokens - 1
            key = f"{o.pool if speculative else 'none'}|{o.slice}|{bucket}"
            sums, w = self._sums_for("tpot", key, t, 2)
            sums.head[0] += w * n
            sums.head[1] += w * o.tpot_s * n
            sums.ever[0] += n
            self._frozen["tpot"][key] = MeanSummary(t_ref=sums.t_ref, weight=sums.head[0], total=sums.head[1],
                                                    ever_weight=sums.ever[0])
        if not speculative or o.verify_ct <= 0:
            return
        reached, accepted = self._positions(o)
        for route in (o.route, "*"):
            key = f"{route}|{o.slice}|{o.pool}|{o.pair_version}"
            sums, w = self._sums_for("acceptance", key, t, 4)
            head = sums.head
            head[0] += w
            head[1] += w * o.verify_ct
            head[2] += w * o.completion_tokens
            head[3] += w * (reached[0] if reached else 0)
            ever = sums.ever
            ever[0] += 1
            ever[1] += o.verify_ct
            ever[3] += reached[0] if reached else 0
            sums.add_positions(reached, accepted, w)
            self._frozen["acceptance"][key] = AcceptanceSummary(
                t_ref=sums.t_ref, requests=head[0], rounds=head[1], tokens=head[2], curve_rounds=head[3],
                reached=tuple(sums.a), accepted=tuple(sums.b), ever_requests=ever[0], ever_rounds=ever[1],
                ever_curve_rounds=ever[3])
        if o.tpot_s is not None and o.completion_tokens >= 2:
            per_round = o.tpot_s * (o.completion_tokens - 1) / o.verify_ct
            self._fit("rounds", f"{o.pool}|{bucket}", t, o.draft_tokens, per_round, o.verify_ct)
            self._fit("rounds", f"{o.pool}|{o.slice}|{bucket}", t, o.draft_tokens, per_round, o.verify_ct)
        for table, total in (("draft", o.draft_s), ("verify", o.verify_s)):
            if total is not None:
                self._fit(table, f"{o.pool}|{bucket}", t, o.draft_tokens, total / o.verify_ct, o.verify_ct)

    @staticmethod
    def _positions(o: Outcome) -> tuple[list[int], list[int]]:
        if o.reached_per_position is not None and o.accepted_per_position is not None:
            return list(o.reached_per_position), list(o.accepted_per_position)
        if o.correct_drafts_histogram:
            return counts_from_histogram(o.correct_drafts_histogram, o.draft_tokens)
        return [], []

    def _fit(self, table: str, key: str, t: float, k: int, y: float, rounds: int) -> None:
        sums, w = self._sums_for(table, key, t, 5)
        sums.ever[0] += rounds
        sums.ever_by_k[k] = sums.ever_by_k.get(k, 0.0) + rounds
        w *= rounds
        h = sums.head
        h[0] += w
        h[1] += w * k
        h[2] += w * k * k
        h[3] += w * y
        h[4] += w * k * y
        self._frozen[table][key] = FitSummary(t_ref=sums.t_ref, w=h[0], sk=h[1], skk=h[2], sy=h[3], sky=h[4],
                                              ever_w=sums.ever[0], ever_by_k=dict(sums.ever_by_k))

    def forget_pair_versions(self, keep: set[str]) -> None:
        """Drop acceptance statistics of pair versions not in ``keep`` (after a reload retired them)."""
        for key in [k for k in self._frozen["acceptance"] if k.rsplit("|", 1)[1] not in keep]:
            del self._frozen["acceptance"][key]
            del self._sums[("acceptance", key)]

    def snapshot(self, now: float, pools: dict[str, PoolState], concurrency: int) -> Snapshot:
        """An immutable view at ``now`` (O(number of keys): the summaries are already frozen)."""
        f = self._frozen
        return Snapshot(SnapshotData(
            now=now, concurrency=concurrency, half_life_s=self.learning.half_life_s,
            buckets=list(self.learning.concurrency_buckets), pools=dict(pools),
            acceptance=dict(f["acceptance"]), tpot=dict(f["tpot"]), rounds=dict(f["rounds"]),
            draft=dict(f["draft"]), verify=dict(f["verify"])))
