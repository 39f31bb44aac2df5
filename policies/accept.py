"""Acceptance statistics: decayed per-position counts, the accept length, E[P](k).

For draft position j (1-based), ``reached_j`` counts rounds whose draft budget included position j and
whose drafts 1..j-1 were all accepted; ``accepted_j`` counts those where draft j was accepted too. A
position the proposer left undrafted (suffix drafts by match length, n-gram finds no match) counts as
reached and not accepted: the round got no token there. The conditional acceptance rate is
a_j = accepted_j / reached_j. Rule conditions (``pool.mean_accept_length``...) and dashboards read these;
``auto`` learns from each request's TPOT instead (policies/auto.py), which already prices what acceptance buys.

Expected committed tokens per round with k drafts (accept length, including the recovered/bonus token) is

    E[P](k) = 1 + sum_{j=1..k} prod_{i=1..j} a_i

No constant-alpha assumption: each a_i is measured; the geometric alpha^j model is the special case
a_i = alpha. From a per-round histogram h[n] (rounds that accepted n of k drafts) the counts are
reached_j = sum_{n >= j-1} h[n] and accepted_j = sum_{n >= j} h[n].
"""

from __future__ import annotations

import msgspec


class AcceptanceSummary(msgspec.Struct, frozen=True, kw_only=True):
    """Decayed sums for one (route, slice, pool, pair_version), referenced to time ``t_ref``.
    ``rounds``/``tokens`` come from totals (completion tokens, verify count) and give the observed mean
    accept length; ``curve_rounds`` counts rounds that also carried per-position data."""

    t_ref: float
    requests: float = 0.0
    rounds: float = 0.0
    tokens: float = 0.0
    curve_rounds: float = 0.0
    reached: tuple[float, ...] = ()
    accepted: tuple[float, ...] = ()
    ever_requests: float = 0.0  # requests, rounds and curve_rounds without decay
    ever_rounds: float = 0.0
    ever_curve_rounds: float = 0.0

    @property
    def mean_accept_length(self) -> float | None:
        """Observed committed tokens per round (decay-invariant ratio); None without rounds."""
        return self.tokens / self.rounds if self.rounds > 0 else None


def expected_tokens(curve: list[float]) -> list[float]:
    """[E[P](0), E[P](1), ..., E[P](len(curve))]; E[P](0) = 1 (plain decoding)."""
    out = [1.0]
    survive = 1.0
    for a in curve:
        survive *= a
        out.append(out[-1] + survive)
    return out


def counts_from_histogram(histogram: list[int], k: int) -> tuple[list[int], list[int]]:
    """(reached, accepted) per position 1..k from rounds-by-accepted-count ``histogram``."""
    reached, accepted = [0] * k, [0] * k
    tail = 0
    for n in range(len(histogram) - 1, -1, -1):
        tail += histogram[n]
        if n < k:
            reached[n] = tail
        if 0 < n <= k:
            accepted[n - 1] = tail
    return reached, accepted
