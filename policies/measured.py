"""Reading measured points: linearly between them, and through a fit that never falls (a forward's seconds by the
tokens it feeds). Replay's cost model reads its grids this way (policies/costmodel.py), as the engine reads its live
step-cost table (``backends.engine.step_costs``, with SciPy; policies stay free of it). Pure Python.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence


def line(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """``ys`` at ``x``: linear between the two measured points around ``x``. Outside ``[xs[0], xs[-1]]``
    the line through the two nearest points where it rises away from the grid, else the nearest point's
    value: a cost never falls below the one measured at the nearest point."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    value = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if x < x0:
        return max(value, y0)
    if x > x1:
        return max(value, y1)
    return value


def non_decreasing(values: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit of ``values`` (isotonic regression, pool adjacent violators): the same
    fit as SciPy's ``isotonic_regression``, which the engine uses; policies stay free of SciPy."""
    blocks: list[list[float]] = []  # [mean, count] of each pooled run
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean, count), (before, n) = blocks.pop(), blocks[-1]
            blocks[-1] = [(before * n + mean * count) / (n + count), n + count]
    return [mean for mean, count in blocks for _ in range(int(count))]


def centered_fit(xs: Sequence[float], values: Sequence[float]) -> list[float]:
    """Centered isotonic regression (Oron & Flournoy 2017) of ``values`` measured at the ascending ``xs``, read at
    ``xs``: the :func:`non_decreasing` fit with each run of equal fitted values replaced by the straight line
    between its neighbours' centres (a run's centre: its mean x, its value). Flat only at the ends, inside the first
    or last run. A least-squares fit pools a noisy dip into a flat run, so a wider forward cost nothing more
    there, and the per-round rule drafted through it (replay on the EPYC's live costs, c4: 1.036x fixed suffix-k8
    before, 0.996x after; the real engine could not tell, docs/runs/2026-12-07-centered-fit); the centred fit
    keeps the average slope. The engine's
    ``step_costs.centered`` is the same fit (SciPy's isotonic regression underneath; a test checks they agree)."""
    fitted = non_decreasing(values)
    knots_x, knots_y, start = [], [], 0
    for i in range(1, len(xs) + 1):
        if i == len(xs) or fitted[i] != fitted[start]:
            knots_x.append(sum(xs[start:i]) / (i - start))
            knots_y.append(fitted[start])
            start = i
    if len(knots_x) == 1:  # one run: flat
        return fitted
    return [knots_y[0] if x <= knots_x[0] else knots_y[-1] if x >= knots_x[-1] else line(knots_x, knots_y, x)
            for x in xs]
