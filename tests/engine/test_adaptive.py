"""The adaptive draft-length controller, driven by scripted traces (STYLE.md #7)."""

from __future__ import annotations

import pytest

from backends.engine.adaptive import AdaptiveDraftLength, StepCosts

# Costs shaped like this CPU in fp32 (DESIGN.md: 43 / 68 / 82 ms for widths 1 / 5 / 9).
FP32 = {1: 0.043, 2: 0.050, 3: 0.056, 5: 0.068, 9: 0.082, 17: 0.110}


def controller(k_max: int = 8, prior: float = 0.5, draft_s: float | None = None) -> AdaptiveDraftLength:
    costs = StepCosts(forward_s=dict(FP32))
    if draft_s is not None:
        costs.draft_token_s["draft_model"] = draft_s
    return AdaptiveDraftLength(k_max=k_max, proposer="draft_model" if draft_s else "ngram", costs=costs,
                               prior=prior)


def test_expected_tokens_is_one_plus_sum_of_survival_products():
    c = controller(k_max=3)
    c.accept = [0.5, 0.5, 0.5]
    assert c.expected_tokens(0) == 1.0
    assert c.expected_tokens(3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_perfect_acceptance_drives_k_to_the_maximum():
    c = controller(k_max=8)
    for _ in range(40):  # every draft accepted, every round
        c.observe(proposed=8, accepted=8)
    assert min(c.accept) > 0.99
    assert c.choose() == 8


def test_rejections_drive_k_to_zero_and_probe_every_eighth_round():
    c = controller(k_max=8)
    for _ in range(30):  # every first draft rejected
        c.observe(proposed=4, accepted=0)
    assert c.accept[0] < 0.01
    choices = [c.choose() for _ in range(16)]
    assert choices == [0] * 7 + [1] + [0] * 7 + [1]


def test_only_reached_positions_are_updated():
    c = controller(k_max=4)
    c.observe(proposed=4, accepted=1)  # position 1 accepted, position 2 rejected, 3-4 not reached
    assert c.accept == [pytest.approx(0.625), pytest.approx(0.375), 0.5, 0.5]


def test_choice_at_the_exact_break_even_prefers_plain():
    # k = 1 pays iff (1 + a_1) / t(2) > 1 / t(1); at equality the plain step wins (strict >).
    c = controller(k_max=1)
    c.accept = [FP32[2] / FP32[1] - 1]
    assert c.choose() == 0
    c.accept = [FP32[2] / FP32[1] - 1 + 1e-9]
    assert c.choose() == 1


def test_expensive_draft_model_needs_higher_acceptance_than_ngram():
    ngram, draft = controller(k_max=4), controller(k_max=4, draft_s=0.02)
    ngram.accept = draft.accept = [0.3] * 4
    assert ngram.choose() >= 1
    assert draft.choose() == 0


def test_unmeasured_widths_fall_back_to_the_nearest_measured_scaled_up():
    costs = StepCosts(forward_s={1: 0.04, 9: 0.08})
    assert costs.forward(10) == pytest.approx(0.08 * 10 / 9)
    assert costs.forward(2) == pytest.approx(0.08)  # nearest is 1 -> scaled by 2
    assert StepCosts().forward(3) == 3.0  # uncalibrated: proportional to width
