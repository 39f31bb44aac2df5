"""Reading measured points (policies/measured.py): the least-squares non-decreasing fit equals SciPy's, and the
centred fit never falls, rises between its runs and keeps rising data as measured."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.optimize import isotonic_regression

from policies.measured import centered_fit, non_decreasing


@given(st.lists(st.floats(0.001, 10.0), min_size=1, max_size=12))
def test_the_fit_is_scipys_isotonic_regression(values):
    """policies/ stay free of SciPy; the engine fits its live table with SciPy (step_costs.py): the two agree."""
    assert non_decreasing(values) == pytest.approx(isotonic_regression(values).x.tolist(), rel=1e-12, abs=1e-15)


@given(st.lists(st.tuples(st.integers(1, 4), st.floats(0.001, 10.0)), min_size=1, max_size=12))
def test_the_centred_fit_never_falls_rises_between_runs_and_keeps_rising_data(steps_values):
    """Non-decreasing everywhere; strictly rising between the first run's centre and the last one's (no flat
    stretch inside, where a wider forward would cost nothing more); rising data come back as measured."""
    xs = list(itertools.accumulate(step for step, _ in steps_values))
    values = [value for _, value in steps_values]
    fit = centered_fit(xs, values)
    assert all(b >= a for a, b in zip(fit, fit[1:]))
    pooled = non_decreasing(values)
    runs = [i for i in range(len(xs)) if i == 0 or pooled[i] != pooled[i - 1]]
    if len(runs) > 1:  # strictly rising from the end of the first run to the start of the last
        inner = fit[runs[1] - 1:runs[-1] + 1]
        assert all(b > a for a, b in zip(inner, inner[1:]))
    if all(b > a for a, b in zip(values, values[1:])):
        assert fit == pytest.approx(values)
