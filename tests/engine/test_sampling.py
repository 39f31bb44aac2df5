"""Each logits transformation on hand-computed vectors, and identical processing for p and q."""

from __future__ import annotations

import math

import pytest
import torch

from backends.engine.sampling import PenaltyState, probs_from_logits, process_logits, sample
from backends.engine.types import SamplingParams

INF = float("inf")


def row(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def test_temperature_divides_logits_and_greedy_leaves_them():
    logits = row(2.0, -4.0, 1.0)
    assert torch.equal(process_logits(logits, SamplingParams(temperature=0.5), None, [], frozenset()),
                       row(4.0, -8.0, 2.0))
    assert torch.equal(process_logits(logits, SamplingParams(temperature=0.0), None, [], frozenset()), logits)


def test_top_k_keeps_the_k_largest():
    probs = probs_from_logits(row(math.log(0.5), math.log(0.3), math.log(0.2)), SamplingParams(top_k=2))
    assert torch.allclose(probs, row(0.625, 0.375, 0.0))


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = row(math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05))
    # mass before each token: 0, 0.5, 0.8, 0.95 -> top_p = 0.8 keeps the first two (0.8 is not < 0.8)
    assert torch.allclose(probs_from_logits(logits, SamplingParams(top_p=0.8)), row(0.625, 0.375, 0, 0))
    assert torch.allclose(probs_from_logits(logits, SamplingParams(top_p=0.81)),
                          row(0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0))
    assert torch.allclose(probs_from_logits(logits, SamplingParams(top_p=0.1)), row(1, 0, 0, 0))


def test_min_p_drops_tokens_below_a_fraction_of_the_max():
    logits = row(math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05))
    # floor = 0.4 * 0.5 = 0.2 keeps 0.5 and 0.3
    assert torch.allclose(probs_from_logits(logits, SamplingParams(min_p=0.4)), row(0.625, 0.375, 0, 0))


def test_top_k_then_top_p_compose():
    logits = row(math.log(0.4), math.log(0.3), math.log(0.2), math.log(0.1))
    # top_k=3 -> (4/9, 3/9, 2/9, 0); mass before: 0, 4/9, 7/9 -> top_p=0.7 keeps two
    probs = probs_from_logits(logits, SamplingParams(top_k=3, top_p=0.7))
    assert torch.allclose(probs, row(4 / 7, 3 / 7, 0, 0))


def state(prompt: list[int], output: list[int], vocab: int = 4) -> PenaltyState:
    s = PenaltyState.create(prompt, vocab)
    s.commit(output)
    return s


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = process_logits(row(4.0, -4.0, 4.0, -4.0), params, state([0], [1]), [], frozenset())
    assert torch.equal(out, row(2.0, -8.0, 4.0, -4.0))  # tokens 0 (prompt) and 1 (output) are penalised


def test_frequency_and_presence_penalties_use_output_counts_only():
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=1.0)
    out = process_logits(row(0.0, 0.0, 0.0, 0.0), params, state([3], [1, 1, 2]), [], frozenset())
    # token 1: 0.5*2 + 1 = 2; token 2: 0.5*1 + 1 = 1.5; prompt token 3 untouched
    assert torch.equal(out, row(0.0, -2.0, -1.5, 0.0))


def test_penalties_count_the_drafts_before_each_position():
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    logits = torch.zeros(3, 4)
    out = process_logits(logits, params, state([], [2]), drafts=[1, 1], stop_ids=frozenset())
    expected = torch.tensor([[0.0, 0.0, -1.0, 0.0],   # position 0: history = committed output
                             [0.0, -1.0, -1.0, 0.0],  # position 1: + draft 1
                             [0.0, -2.0, -1.0, 0.0]])  # position 2: + drafts 1, 1
    assert torch.equal(out, expected)


def test_min_new_tokens_masks_stop_tokens_only_while_output_is_short():
    params = SamplingParams(temperature=0.0, min_new_tokens=3)
    logits = torch.zeros(3, 4)
    out = process_logits(logits, params, state([], [0]), drafts=[1, 1], stop_ids=frozenset({3}))
    # output lengths seen by the three positions: 1, 2, 3 -> mask at the first two
    assert out[:, 3].tolist() == [-INF, -INF, 0.0]
    assert torch.equal(out[:, :3], torch.zeros(3, 3))


def test_temperature_applies_after_penalties():
    params = SamplingParams(temperature=2.0, presence_penalty=1.0)
    out = process_logits(row(3.0, 3.0, 0.0, 0.0), params, state([], [0]), [], frozenset())
    assert torch.equal(out, row(1.0, 1.5, 0.0, 0.0))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                   min_new_tokens=4, top_k=20, top_p=0.9, min_p=0.01),
    SamplingParams(temperature=0.0, repetition_penalty=1.1, min_new_tokens=2),
    SamplingParams(temperature=1.0, top_p=0.5),
])
def test_one_position_at_start_j_equals_row_j_of_the_multi_position_call(params):
    """The draft model scores draft j alone (start=j); the target scores all k+1 rows at once."""
    g = torch.Generator().manual_seed(3)
    vocab, drafts = 50, [7, 7, 3, 11]
    logits = torch.randn(len(drafts) + 1, vocab, generator=g) * 3
    penalty = state([1, 2, 7], [3, 4], vocab)
    stops = frozenset({11, 49})
    target = process_logits(logits, params, penalty, drafts, stops)
    target_probs = probs_from_logits(target, params)
    for j in range(len(drafts) + 1):
        draft = process_logits(logits[j:j + 1], params, penalty, drafts[:j], stops, start=j)
        assert torch.equal(draft[0], target[j])
        assert torch.equal(probs_from_logits(draft, params)[0], target_probs[j])


def test_sample_draws_in_proportion_to_unnormalised_weights_and_never_a_zero():
    from scipy.stats import chisquare

    weights = torch.zeros(49152)
    support = [0, 7, 100, 20000, 49151]  # both ends of the vocabulary, zeros between
    weights[support] = torch.tensor([3.0, 0.5, 1.0, 2.5, 1.0])  # total 8.0: not normalised
    generator = torch.Generator().manual_seed(1234)
    draws = [sample(weights, generator) for _ in range(8000)]
    assert set(draws) <= set(support)  # a zero weight is never drawn
    observed = [draws.count(token) for token in support]
    expected = [8000 * float(weights[token]) / 8.0 for token in support]
    assert chisquare(observed, expected).pvalue > 1e-3  # the seed is fixed: this is one deterministic check
    again = torch.Generator().manual_seed(1234)
    assert [sample(weights, again) for _ in range(50)] == draws[:50]  # the request's generator alone decides
    one_hot = torch.zeros(49152)
    one_hot[49151] = 1.0
    assert {sample(one_hot, generator) for _ in range(100)} == {49151}
