"""The pair gates' statistics, pure functions over counts and samples (SciPy): the serving gate's window
check, the collapse detector's floor and histogram shift, the outcome gate's one-sided test, and the chi-square
homogeneity test both the collapse detector and the equivalence gate's sampled check use.

SciPy is imported when a test first runs, not with the gateway: it doubles the objects a gateway process
holds (numpy comes with it), which every full garbage collection walks on the request path, and adds half a
second to start-up; a gateway without gates never needs it."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence

from gateway.gates.values import Sample
from policies.schema import Collapse, OutcomeCheck, Serving


def chi_square(rows: Sequence[Sequence[int]]) -> float | None:
    """p-value of a chi-square test of homogeneity over count rows of any lengths (padded with zeros; columns
    empty in every row dropped), or None when fewer than two columns or an empty row leave nothing to test."""
    width = max(map(len, rows), default=0)
    padded = [list(r) + [0] * (width - len(r)) for r in rows]
    columns = [i for i in range(width) if any(r[i] for r in padded)]
    if len(columns) < 2 or not all(sum(r) for r in padded):
        return None
    from scipy import stats as scistats  # here, not at the top: module docstring

    return float(scistats.chi2_contingency([[r[i] for i in columns] for r in padded]).pvalue)


def homogeneity(spec: list[list[int]], plain: list[list[int]]) -> tuple[float | None, int]:
    """Smallest per-position chi-square p-value between two sets of sampled outputs, and how many positions
    were testable (tokens seen fewer than 5 times in all are pooled into one category)."""
    smallest, tested = None, 0
    for j in range(max(map(len, spec + plain), default=0)):
        a = Counter(ids[j] for ids in spec if len(ids) > j)
        b = Counter(ids[j] for ids in plain if len(ids) > j)
        total = a + b
        common = [t for t, n in total.items() if n >= 5]
        p = chi_square([[side[t] for t in common] + [sum(n for t, n in side.items() if total[t] < 5)]
                        for side in (a, b)])
        if p is not None:
            smallest, tested = p if smallest is None else min(smallest, p), tested + 1
    return smallest, tested


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def serving_misses(serving: Serving, spec: list[Sample], plain: list[Sample]) -> tuple[list[str], str]:
    """Which of the serving gate's bounds a window misses, and the window's figures."""
    misses, figures = [], []
    for name, bound, read in (("TPOT", serving.max_tpot_ratio, lambda s: s.tpot_s),
                              ("TTFT", serving.max_ttft_ratio, lambda s: s.ttft_s)):
        mine = median([v for s in spec if (v := read(s)) is not None])
        base = median([v for s in plain if (v := read(s)) is not None])
        if mine is None or not base:
            continue
        ratio = mine / base
        figures.append(f"{name} {ratio:.2f}x plain")
        if ratio > bound:
            misses.append(f"p50 {name} {ratio:.2f}x plain > {bound:g}")
    met = [s.slo_met for s in spec if s.slo_met is not None]
    base = [s.slo_met for s in plain if s.slo_met is not None]
    if met and base:
        mine_rate, base_rate = sum(met) / len(met), sum(base) / len(base)
        ratio = mine_rate / base_rate if base_rate else (1.0 if mine_rate == 0 else math.inf)
        figures.append(f"SLO {mine_rate:.2f} vs {base_rate:.2f}")
        if ratio < serving.min_slo_ratio:
            misses.append(f"SLO attainment {ratio:.2f}x plain < {serving.min_slo_ratio:g}")
    return misses, ", ".join(figures) or "no timings"


def sum_histograms(histograms: Iterable[Sequence[int]]) -> tuple[int, ...]:
    """Element-wise sum of histograms of different lengths."""
    total: list[int] = []
    for h in histograms:
        if len(h) > len(total):
            total += [0] * (len(h) - len(total))
        for i, n in enumerate(h):
            total[i] += n
    return tuple(total)


def collapsed(collapse: Collapse, accept: float, histogram: tuple[int, ...], baseline: float | None,
               base_histogram: tuple[int, ...] | None) -> str | None:
    """Why a window's acceptance counts as collapsed against its baseline, or None."""
    if baseline is not None and baseline >= collapse.min_baseline and accept < collapse.floor:
        return (f"accept length {accept:.2f} per round < floor {collapse.floor:g} (baseline {baseline:.2f})")
    if collapse.shift_alpha is None or not base_histogram or not histogram:
        return None
    mean_now = sum(i * n for i, n in enumerate(histogram)) / max(1, sum(histogram))
    mean_base = sum(i * n for i, n in enumerate(base_histogram)) / max(1, sum(base_histogram))
    # a shift DOWN by at least half: rounds within a request are correlated and traffic mixes change, so
    # significance alone would flag ordinary variation between windows
    if mean_now >= 0.5 * mean_base:
        return None
    p = chi_square([histogram, base_histogram])
    if p is None:
        return None
    if p < collapse.shift_alpha:
        return (f"accepted drafts per round fell from {mean_base:.2f} to {mean_now:.2f} "
                f"(histogram shift, chi-square p = {p:.2g} < {collapse.shift_alpha:g})")
    return None


def worse(spec: list[float], plain: list[float], outcome: OutcomeCheck) -> float | None:
    """One-sided p-value that the speculative mean is below plain's minus ``max_drop`` (Welch's t), or None
    before both sides have ``min_reports``."""
    if len(spec) < outcome.min_reports or len(plain) < outcome.min_reports:
        return None
    shifted = [x - outcome.max_drop for x in plain]
    if statistics.pvariance(spec) == 0 and statistics.pvariance(shifted) == 0:
        return 0.0 if statistics.fmean(spec) < statistics.fmean(shifted) else 1.0
    from scipy import stats as scistats  # here, not at the top: module docstring

    return float(scistats.ttest_ind(spec, shifted, equal_var=False, alternative="less").pvalue)
