"""The learner: the one object with memory (CONTRIBUTING.md #7). It turns request outcomes into time-decayed sums
and hands out immutable snapshots; decisions never read it directly.

Update formulas (for every sum S kept under a key, with half-life H seconds):

    on an outcome at time t >= t_ref:  S <- S * 2^(-(t - t_ref) / H) + x;  t_ref <- t
    on a late outcome (t < t_ref):     S <- S + x * 2^(-(t_ref - t) / H)

Keys and what x is:

- acceptance ``route|slice|pool|pair_version`` and ``*|slice|pool|pair_version``: requests += 1,
  rounds += verify_ct, tokens += completion_tokens, and per draft position j: reached_j, accepted_j
  (given directly, or from the accepted-drafts histogram, see :mod:`policies.accept`); curve_rounds +=
  rounds that carried such data. A new pair version is a new key, so its statistics start from the prior.
- arms ``slice|bucket|band|option`` (auto's Thompson sampling, :mod:`policies.auto`): per request with a TPOT
  (two tokens or more), w += 1, sy += log(y), syy += log(y)^2 with y = tpot_s + neighbour_tpot_s (the request's
  TPOT, charged with what its drafts cost the sequences beside it); bucket = the learner's concurrency
  bucket of the request's mean concurrency, band = its ``prompt_repeat`` band, option ``none`` (served without
  speculation) or ``pool@k#pair_version`` (k requested).
- gaps ``slice|bucket|band|option`` (the same keys, speculative options only): per request whose worker estimated
  plain decoding's TPOT for it (``Outcome.plain_tpot_s``), w += 1, sy += log(y / plain_tpot_s), syy += its
  square: the option's paired log speedup over plain, request by request.
- full information: each option of ``Outcome.counterfactual`` (a greedy request's price of the rule's fixed-k
  model-free options it did not get, replay/evidence.py) adds one observation to its arms and gaps keys, as
  if that option had served the request.

Each key also keeps its sums without decay (``ever_*``): how much evidence was ever seen.

Failed outcomes (ok False) only count in ``failures``. Works from per-request totals alone (SGLang): auto
needs only each request's TPOT; the acceptance sums then hold totals (rule conditions, dashboards).
"""

from __future__ import annotations

import bisect
import math

import msgspec

from policies.accept import AcceptanceSummary, counts_from_histogram
from policies.auto import PLAIN, option_label, repeat_band
from policies.schema import Learning
from policies.snapshot import ArmSummary, PoolState, Snapshot, SnapshotData


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
    prompt_repeat: float | None = None  # the request's feature (auto's context: its repeat band)
    # a speculative request's counterfactual: the TPOT plain decoding would have had, as the worker estimates it
    # (its measured TPOT times the ``specgate_plain_ratio`` it reports); auto counts it as evidence for plain
    plain_tpot_s: float | None = None
    # what its drafts cost the other sequences of its steps, per output token: the worker's
    # ``specgate_neighbour_s`` over completion_tokens - 1. auto's objective is the request's TPOT plus this, the
    # engine-seconds its choice costs per output token (a speculative option that slows the sequences beside it
    # pays for it); plain decoding's is 0
    neighbour_tpot_s: float = 0.0
    # full-information evidence (replay/evidence.py): what each option of the rule it did not get would have
    # charged per output token (engine-seconds, as ``tpot_s + neighbour_tpot_s``), by the learner's option label
    counterfactual: dict[str, float] = {}


def with_counterfactuals(o: Outcome, ratios: dict[str, float], served_ratio: float | None) -> Outcome:
    """``o`` with the counterfactual evidence of ``ratios`` (each option's price over plain decoding's on this
    answer, replay/evidence.py): each option's charged TPOT is its ratio times the request's plain TPOT, which is
    the measured one when it was served plain, else the worker's estimate (``plain_tpot_s``), else the measured
    charge over ``served_ratio`` (the served option's own price ratio: a fixed-k model-free pool, so a server
    reporting no plain estimate still gets one, and it counts as plain's evidence too). Unchanged without one."""
    if o.tpot_s is None or not ratios and served_ratio is None:
        return o
    speculative = o.proposer != "none" and o.draft_tokens > 0
    plain, derived = (o.tpot_s, None) if not speculative else (o.plain_tpot_s, None)
    if plain is None and served_ratio:
        plain = derived = (o.tpot_s + o.neighbour_tpot_s) / served_ratio
    if plain is None:
        return o
    return msgspec.structs.replace(
        o, counterfactual={label: plain * r for label, r in ratios.items()},
        plain_tpot_s=derived if derived is not None else o.plain_tpot_s)


class _Sums:
    """Mutable decayed sums: ``head`` fixed-size, ``a``/``b`` growable per-position lists."""

    __slots__ = ("t_ref", "head", "a", "b", "ever")

    def __init__(self, t: float, size: int) -> None:
        self.t_ref, self.head, self.a, self.b = t, [0.0] * size, [], []
        self.ever = [0.0] * size  # ``head`` without decay: how much evidence was ever seen

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
    """Rolling acceptance and TPOT statistics (formulas in the module docstring)."""

    def __init__(self, learning: Learning | None = None) -> None:
        self.learning = learning or Learning()
        self.failures = 0
        self._sums: dict[tuple[str, str], _Sums] = {}
        self._frozen: dict[str, dict[str, msgspec.Struct]] = {
            "acceptance": {}, "arms": {}, "gaps": {}}

    def configure(self, learning: Learning) -> None:
        """Adopt a reloaded policy's learning settings; statistics are kept."""
        self.learning = learning

    def tables(self) -> dict[str, dict[str, msgspec.Struct]]:
        """This learner's own frozen summaries by table (read-only: a fleet replica publishes them,
        :mod:`policies.shared_sums`); each key's summary object is replaced, never mutated, when it changes."""
        return self._frozen

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
            charged = o.tpot_s + o.neighbour_tpot_s
            self._arm(o, t, bucket, option_label(o.pool, o.draft_tokens, o.pair_version) if speculative else PLAIN,
                      charged)
            if speculative and o.plain_tpot_s is not None:
                self._arm(o, t, bucket, PLAIN, o.plain_tpot_s)
                self._arm(o, t, bucket, option_label(o.pool, o.draft_tokens, o.pair_version),
                          charged / o.plain_tpot_s, table="gaps")
            plain = o.plain_tpot_s if speculative else charged
            for label, tpot in o.counterfactual.items():  # full-information evidence, as if served
                self._arm(o, t, bucket, label, tpot)
                if plain:
                    self._arm(o, t, bucket, label, tpot / plain, table="gaps")
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

    def _arm(self, o: Outcome, t: float, bucket: int, label: str, tpot_s: float, table: str = "arms") -> None:
        """One request's log TPOT (``table`` arms) or log TPOT ratio to plain's (gaps) under
        ``slice|bucket|band|option`` (auto's Thompson sampling)."""
        key = f"{o.slice}|{bucket}|{repeat_band(self.learning, o.prompt_repeat)}|{label}"
        sums, w = self._sums_for(table, key, t, 3)
        y = math.log(max(tpot_s, 1e-6))
        h = sums.head
        h[0] += w
        h[1] += w * y
        h[2] += w * y * y
        sums.ever[0] += 1
        self._frozen[table][key] = ArmSummary(t_ref=sums.t_ref, w=h[0], sy=h[1], syy=h[2], ever=sums.ever[0])

    @staticmethod
    def _positions(o: Outcome) -> tuple[list[int], list[int]]:
        if o.reached_per_position is not None and o.accepted_per_position is not None:
            return list(o.reached_per_position), list(o.accepted_per_position)
        if o.correct_drafts_histogram:
            return counts_from_histogram(o.correct_drafts_histogram, o.draft_tokens)
        return [], []

    def forget_pair_versions(self, keep: set[str]) -> None:
        """Drop the statistics of pair versions not in ``keep`` (after a reload retired them)."""
        option = lambda key: key.rpartition("#")[2] if "#" in key else None  # noqa: E731
        for table, version in (("acceptance", lambda key: key.rsplit("|", 1)[1]), ("arms", option), ("gaps", option)):
            for key in [k for k in self._frozen[table] if version(k) not in keep | {None}]:
                del self._frozen[table][key]
                del self._sums[(table, key)]

    def snapshot(self, now: float, pools: dict[str, PoolState], concurrency: int) -> Snapshot:
        """An immutable view at ``now`` (O(number of keys): the summaries are already frozen)."""
        f = self._frozen
        return Snapshot(SnapshotData(
            now=now, concurrency=concurrency, half_life_s=self.learning.half_life_s,
            buckets=list(self.learning.concurrency_buckets), pools=dict(pools),
            acceptance=dict(f["acceptance"]), arms=dict(f["arms"]), gaps=dict(f["gaps"])))
