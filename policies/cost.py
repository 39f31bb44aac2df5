"""Cost model: decayed means and decayed linear fits of time against draft length k.

Per pool and concurrency bucket the learner fits ``t_round(k) = c0 + c1 * k`` (seconds per
speculative round: draft + verify + overhead, from ``tpot * (completion_tokens - 1) / verify_ct``) by
weighted least squares over decayed sums. Until two k have ``min_rounds`` rounds each (counted without
decay) the fitted slope is not trusted: the prior ``c1 = draft_token_cost * c0`` (each extra draft token
costs that fraction of a round) is used above the mean measured k, and below it a round is predicted to
cost what the measured ones did (never a guessed saving). The same fit is kept for ``draft_s`` and
``verify_s`` when the worker reports them, for display (overhead = round - draft - verify). Plain
decoding is measured directly as TPOT of requests served without speculation, per slice and bucket.
"""

from __future__ import annotations

import msgspec


class MeanSummary(msgspec.Struct, frozen=True, kw_only=True):
    """Decayed weight and weighted sum of one quantity (mean = total / weight)."""

    t_ref: float
    weight: float = 0.0
    total: float = 0.0
    ever_weight: float = 0.0  # weight without decay

    @property
    def evidence(self) -> float:
        """Undecayed weight: how much was ever measured (tokens for a TPOT)."""
        return self.ever_weight

    @property
    def mean(self) -> float | None:
        return self.total / self.weight if self.weight > 0 else None


class FitSummary(msgspec.Struct, frozen=True, kw_only=True):
    """Decayed sums w, w*k, w*k^2, w*y, w*k*y for a least-squares line y = c0 + c1 * k."""

    t_ref: float
    w: float = 0.0
    sk: float = 0.0
    skk: float = 0.0
    sy: float = 0.0
    sky: float = 0.0
    ever_w: float = 0.0  # w without decay
    ever_by_k: dict[int, float] = {}  # w without decay, per k

    @property
    def evidence(self) -> float:
        """Undecayed weight: how many rounds were ever measured."""
        return self.ever_w

    @property
    def identified(self) -> bool:
        """More than one k measured: the slope is fitted, not the prior's."""
        return self.w > 0 and self.skk / self.w - (self.sk / self.w) ** 2 > 1e-6

    def slope_measured(self, min_rounds: float) -> bool:
        """Measured at two or more k with ``min_rounds`` rounds each (counted without decay): only then is
        the fitted slope trusted. One short request at a second k, timed during a load spike, once fitted a
        slope steep enough to make k=2 look best, and it was slower than k=8."""
        return self.identified and sum(v >= min_rounds for v in self.ever_by_k.values()) >= 2

    def coefficients(self, draft_token_cost: float, fitted: bool = True) -> tuple[float, float] | None:
        """(c0, c1), or None without data. Slope clamped at >= 0 (more drafts never cost less). With
        ``fitted`` False, or one k measured, the prior slope around the mean."""
        if self.w <= 0:
            return None
        mean_k, mean_y = self.sk / self.w, self.sy / self.w
        var_k = self.skk / self.w - mean_k * mean_k
        if fitted and var_k > 1e-6:
            c1 = max(0.0, (self.sky / self.w - mean_k * mean_y) / var_k)
            return mean_y - c1 * mean_k, c1
        c0 = mean_y / (1.0 + draft_token_cost * mean_k)
        return c0, draft_token_cost * c0

    def round_time(self, draft_token_cost: float, min_rounds: float = 0.0) -> RoundTime | None:
        """The round-time line to predict from, or None without data; computed once per pool and snapshot,
        then asked for every k. Until the slope is measured (:meth:`slope_measured`), a draft shorter than
        the mean measured k is predicted no cheaper than the measured rounds (the prior slope is only a
        guess, and a guessed-cheap short round made auto serve k=1 at 1.84x predicted, under 1x measured);
        a longer one costs the prior slope more. Auto measures a second k soon
        (:func:`policies.auto.slope_probe`)."""
        fitted = self.slope_measured(min_rounds)
        coef = self.coefficients(draft_token_cost, fitted)
        if coef is None:
            return None
        return RoundTime(c0=coef[0], c1=coef[1], slope_measured=fitted, mean_k=self.sk / self.w,
                         mean_s=self.sy / self.w)


class RoundTime(msgspec.Struct, frozen=True, kw_only=True):
    """Seconds per round against k: ``c0 + c1 * k``; below the mean measured k, until the slope is
    measured, the measured mean (no guessed saving)."""

    c0: float
    c1: float
    slope_measured: bool
    mean_k: float
    mean_s: float

    borrowed: bool = False  # the slope comes from another concurrency bucket (:meth:`shaped_like`)

    def predict(self, k: int) -> float:
        if not self.slope_measured and k < self.mean_k:
            return max(1e-9, self.mean_s)
        return max(1e-9, self.c0 + self.c1 * k)

    def shaped_like(self, other: RoundTime) -> RoundTime | None:
        """This bucket's measured level with ``other``'s measured shape: ``other``'s line scaled so that it
        passes through this bucket's mean round (mean_k, mean_s). Load stretches every round of an
        interleaving engine alike, so the cost of a draft token relative to a round carries over from the
        nearest bucket whose slope was measured far better than the prior's guess does; probing it again
        at every new load cost up to 7 of 16 requests of a cell (p0.5, code). None when ``other`` predicts
        no positive time at this mean k."""
        base = other.c0 + other.c1 * self.mean_k
        if base <= 1e-9:
            return None
        scale = self.mean_s / base
        return RoundTime(c0=other.c0 * scale, c1=other.c1 * scale, slope_measured=True, mean_k=self.mean_k,
                         mean_s=self.mean_s, borrowed=True)
