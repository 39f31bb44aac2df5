"""Golden cases for the pure verification functions (CONTRIBUTING.md #2, #11).

Forced logits (+-10, -inf) make the target's choice certain; injected uniforms make each accept /
reject decision certain, so every case has exactly one right answer.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from backends.engine.verify import residual, verify_greedy, verify_sampled

NEG = float("-inf")


def forced_logits(choices: list[int], vocab: int = 5) -> torch.Tensor:
    """[len(choices), vocab] logits: +10 at the chosen token, -10 elsewhere, -inf at the last id."""
    logits = torch.full((len(choices), vocab), -10.0)
    logits[:, vocab - 1] = NEG
    for row, token in enumerate(choices):
        logits[row, token] = 10.0
    return logits


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- greedy ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("target", "drafts", "accepted", "tokens"), [
    ([1, 2, 3, 0], [1, 2, 3], 3, [1, 2, 3, 0]),  # all accepted, bonus = argmax of the last row
    ([1, 2, 3, 0], [1, 3, 3], 1, [1, 2]),  # first mismatch at position 2: recovered = target's choice
    ([1, 2, 3, 0], [0, 2, 3], 0, [1]),  # rejected at once: exactly one plain step
    ([2], [], 0, [2]),  # k = 0 is a plain greedy step
])
def test_verify_greedy_golden(target, drafts, accepted, tokens):
    verdict = verify_greedy(forced_logits(target), drafts)
    assert verdict.accepted == accepted
    assert verdict.tokens == tokens
    assert verdict.bonus == (accepted == len(drafts))


def test_verify_greedy_never_accepts_a_minus_inf_token():
    logits = forced_logits([1, 1])
    logits[0] = NEG
    logits[0, 2] = -1e9  # the only finite entry wins, even when very negative
    assert verify_greedy(logits, [4]).tokens == [2]


# ---- sampled, deterministic proposer (q = one-hot) -----------------------------------------------
def probs(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_sampled_one_hot_accepts_iff_uniform_below_p():
    target = probs([[0.1, 0.6, 0.3], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    accept_all = verify_sampled(target, None, [1, 0], gen(), uniforms=[0.59, 0.49])
    assert (accept_all.accepted, accept_all.bonus, accept_all.tokens) == (2, True, [1, 0, 2])
    reject_second = verify_sampled(target, None, [1, 0], gen(), uniforms=[0.59, 0.5])
    # residual at row 1 with token 0 removed is all on token 1
    assert (reject_second.accepted, reject_second.bonus, reject_second.tokens) == (1, False, [1, 1])


def test_sampled_one_hot_rejects_a_token_the_target_forbids():
    target = probs([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    verdict = verify_sampled(target, None, [0], gen(), uniforms=[0.0])  # p(x) = 0: u < 0 is impossible
    assert verdict.accepted == 0 and verdict.tokens == [1]


def test_residual_one_hot_removes_the_draft_and_renormalises():
    res = residual(probs([[0.2, 0.5, 0.3]])[0], None, 1)
    assert torch.allclose(res, probs([[0.4, 0.0, 0.6]])[0])


def test_residual_when_p_equals_q_falls_back_to_p():
    p = probs([[0.25, 0.75]])[0]
    assert torch.equal(residual(p, p.clone(), 0), p)
    assert torch.equal(residual(probs([[0.0, 1.0]])[0], None, 1), probs([[0.0, 1.0]])[0])


# ---- sampled with a draft distribution q: the two-symbol example ----------------------------------
P_AB = (Fraction(6, 10), Fraction(4, 10))
Q_AB = (Fraction(8, 10), Fraction(2, 10))


def test_two_symbol_example_in_exact_arithmetic():
    """p = (0.6, 0.4), q = (0.8, 0.2): accept A w.p. 0.75, B w.p. 1, residual all on B, result = p."""
    accept = [min(Fraction(1), p / q) for p, q in zip(P_AB, Q_AB)]
    assert accept == [Fraction(3, 4), Fraction(1)]
    raw = [max(p - q, Fraction(0)) for p, q in zip(P_AB, Q_AB)]
    res = [r / sum(raw) for r in raw]
    assert res == [Fraction(0), Fraction(1)]
    reject = sum(q * (1 - a) for q, a in zip(Q_AB, accept))
    final = [q * a + reject * r for q, a, r in zip(Q_AB, accept, res)]
    assert final == list(P_AB)  # exactly (0.6, 0.4)


def test_two_symbol_example_through_verify_sampled():
    p = probs([[0.6, 0.4], [0.6, 0.4]])
    q = probs([[0.8, 0.2]])
    assert torch.allclose(residual(p[0], q[0], 0), probs([[0.0, 1.0]])[0])
    # draft A: accepted iff u < 0.75
    assert verify_sampled(p, q, [0], gen(), uniforms=[0.7499]).accepted == 1
    rejected = verify_sampled(p, q, [0], gen(), uniforms=[0.75])
    assert (rejected.accepted, rejected.tokens, rejected.bonus) == (0, [1], False)  # recovered = B
    # draft B: p/q = 2 -> always accepted, even with u just below 1
    assert verify_sampled(p, q, [1], gen(), uniforms=[0.999999]).accepted == 1


def test_two_symbol_example_empirical_distribution():
    """The same example through the sampler (draft drawn from q, uniforms from the generator)."""
    from scipy.stats import chisquare

    seed, n = 20240601, 20000
    g = gen(seed)
    p = probs([[0.6, 0.4], [0.6, 0.4]])
    q = probs([[0.8, 0.2]])
    counts = [0, 0]
    for _ in range(n):
        draft = int(torch.multinomial(q[0], 1, generator=g))
        counts[verify_sampled(p, q, [draft], g).tokens[0]] += 1
    result = chisquare(counts, [0.6 * n, 0.4 * n])
    assert result.pvalue > 1e-3, f"seed={seed} counts={counts} p={result.pvalue}"


def test_sampled_draws_only_from_the_generator():
    """Same generator seed -> same verdict; the global RNG is never consulted."""
    p = torch.softmax(torch.randn(4, 7, generator=gen(1)), -1)
    q = torch.softmax(torch.randn(3, 7, generator=gen(2)), -1)
    torch.manual_seed(0)
    a = verify_sampled(p, q, [1, 2, 3], gen(5))
    torch.manual_seed(12345)
    b = verify_sampled(p, q, [1, 2, 3], gen(5))
    assert a == b
