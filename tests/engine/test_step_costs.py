"""The engine's step-cost table (backends/engine/step_costs.py): interpolation, the step base, the EMA, and the
centred fit it is read through, which replay's pure-Python fit (policies/measured.py) must equal."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.engine.step_costs import StepCosts, centered
from policies.costmodel import Grid
from policies.measured import centered_fit


def test_step_costs_interpolate_between_measured_token_counts_and_add_the_step_base():
    costs = StepCosts(forward_s={(1, 1): 0.04, (1, 9): 0.08, (4, 4): 0.07, (4, 8): 0.09})
    assert costs.forward(10) == pytest.approx(0.08 * 10 / 9)  # beyond the largest: proportional
    assert costs.forward(3) == pytest.approx(0.05)  # a quarter of the way from 1 to 9
    assert costs.forward(6, seqs=4) == pytest.approx(0.08)  # the 4-sequence curve
    assert costs.forward(6, seqs=3) == pytest.approx(0.08)  # nearest measured count: 4
    assert costs.forward(2, seqs=4) == 0.07  # below the smallest: the smallest
    assert StepCosts().forward(3) == 3.0  # uncalibrated: proportional to tokens
    costs.draft_token_s["draft_model"] = 0.01
    costs.observe_overhead(0.002)
    assert costs.round_s("draft_model", 8) == pytest.approx(0.08 + 0.08 + 0.002)
    assert costs.round_s("draft_model", 0) == pytest.approx(0.04 + 0.002)
    costs.step_seqs, costs.step_base = 4, 3  # three other sequences' tokens in the step
    assert costs.round_s("draft_model", 0) == pytest.approx(0.07 + 0.002)
    assert costs.round_s("draft_model", 4) == pytest.approx(0.09 + 0.04 + 0.002)
    costs.observe_forward(4, 0.05, seqs=4)
    assert costs.forward_s[4, 4] == pytest.approx(0.9 * 0.07 + 0.1 * 0.05)
    assert costs.table()[0] == (1, 1, 0.04) and len(costs.table()) == 4


def test_step_costs_are_read_through_a_centred_non_decreasing_fit_that_follows_new_measurements():
    """A noisy entry (12 tokens of 4 sequences measured below 8) never prices a wider forward cheaper, nor as
    cheap: the rule would draft more to reach it. The least-squares fit pools 8 and 12 at 0.045 (a flat run, where
    4 more drafts would cost nothing); the centred fit draws the line from (4, 0.040) through the run's centre
    (10, 0.045) to (16, 0.055). Each measurement refits its sequence count; ``restore`` refits all."""
    costs = StepCosts(forward_s={(4, 4): 0.040, (4, 8): 0.046, (4, 12): 0.044, (4, 16): 0.055, (1, 1): 0.02})
    at_8, at_12 = 0.040 + 0.005 * 4 / 6, 0.045 + 0.010 * 2 / 6  # read at the measured counts, linear between
    assert [costs.forward(t, 4) for t in (4, 8, 10, 12, 16)] == pytest.approx([0.040, at_8, (at_8 + at_12) / 2,
                                                                               at_12, 0.055])
    assert costs.forward(1) == 0.02  # the other count's curve is its own
    costs.observe_forward(12, 0.064, seqs=4)  # EMA: 0.9 * 0.044 + 0.1 * 0.064 = 0.046 -> 8 and 12 tie: one run
    assert [costs.forward(t, 4) for t in (8, 12)] == pytest.approx([0.040 + 0.006 * 4 / 6, 0.046 + 0.009 * 2 / 6])
    costs.observe_forward(6, 0.041, seqs=3)  # a new sequence count: the nearest one is found again
    assert costs.forward(6, 3) == 0.041 and costs.forward(6, 4) == pytest.approx((0.040 + 0.040 + 0.006 * 4 / 6) / 2)
    costs.restore({(4, 4): 0.040, (4, 8): 0.030})  # one run: flat (no neighbour to draw a line to)
    assert costs.forward(8, 4) == pytest.approx(0.035) and costs.forward(6, 3) == pytest.approx(0.035)
    assert costs.table() == [(4, 4, 0.040), (4, 8, 0.030)]  # /server_info: the measurements, fitted by its readers


def test_what_server_info_reports_prices_as_the_engine_once_a_reader_fits_it():
    """Replay's cost model (``Grid``) fits what the worker reports, so the worker reports its measurements: a grid
    of them reads what the engine's ``forward`` reads. A flat first run of three counts is where the centred fit of
    a fit moves: read again, the run's middle count rises."""
    costs = StepCosts(forward_s={(1, 1): 0.050, (1, 2): 0.048, (1, 3): 0.049, (1, 5): 0.052, (1, 9): 0.060})
    reported = [(t, s) for n, t, s in costs.table() if n == 1]
    engine = [costs.forward(t) for t, _ in reported]
    assert engine[0] == engine[1] != engine[2]  # the first run: flat up to its centre
    grid = Grid(tokens=[t for t, _ in reported], context=[32], seconds=[[s] for _, s in reported])
    assert [row[0] for row in grid.fitted] == pytest.approx(engine, rel=1e-12)
    refit = Grid(tokens=grid.tokens, context=[32], seconds=grid.fitted)  # what reporting the fit led to
    assert [row[0] for row in refit.fitted] != pytest.approx(engine, rel=1e-9)


@given(st.lists(st.tuples(st.integers(1, 4), st.floats(0.001, 10.0)), min_size=1, max_size=12))
def test_the_engines_centred_fit_is_replays(steps_values):
    """The engine fits its live table with SciPy (step_costs.centered); replay reads cost files through the
    pure-Python fit (policies.measured.centered_fit, policies stay free of SciPy): the two agree."""
    tokens = list(itertools.accumulate(step for step, _ in steps_values))
    values = [value for _, value in steps_values]
    assert centered(tokens, values) == pytest.approx(centered_fit(tokens, values), rel=1e-9, abs=1e-12)
