"""The per-round draft-length controllers, driven by scripted rounds (CONTRIBUTING.md #7)."""

from __future__ import annotations

import itertools
import math
import operator
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.engine.adaptive import (
    DISCOUNT, GAIN_FLOOR, POOL_STRENGTH, PRIOR_STRENGTH, BetaDraftLength, Evidence, PooledAcceptance, best_k,
    controller_for, expected_tokens, match_context, plan_step, suffix_min,
)
from backends.engine.step_costs import StepCosts
from backends.engine.types import SpeculationParams

# Costs shaped like a CPU in fp32 (one forward of width 1 / 5 / 9: 43 / 68 / 82 ms on an Intel AMX machine).
FP32 = {1: 0.043, 2: 0.050, 3: 0.056, 5: 0.068, 9: 0.082, 17: 0.110}
COSTS = StepCosts(forward_s={(1, width): s for width, s in FP32.items()})


def ngram_cost(k: int) -> float:
    return COSTS.round_s("ngram", k)


def by_k(cost, k_max: int = 16) -> list[float]:
    """A round's seconds for k = 0..k_max drafts, as the controllers and best_k take them."""
    return [cost(k) for k in range(k_max + 1)]


def NGRAM_BY_K(k_max: int) -> list[float]:
    return by_k(ngram_cost, k_max)


def beta(k_max: int = 8, prior: tuple[float, ...] = (), seed: int = 0, cost=ngram_cost) -> BetaDraftLength:
    return BetaDraftLength(k_max=k_max, round_costs=lambda k: by_k(cost, k), prior=prior, seed=seed)


def test_expected_tokens_is_one_plus_sum_of_survival_products():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_best_k_at_the_exact_break_even_prefers_plain():
    # k = 1 pays iff (1 + a_1) / t(2) > 1 / t(1); at equality the plain step wins (strict >).
    even = FP32[2] / FP32[1] - 1
    assert best_k([even], 1, by_k(ngram_cost)) == 0
    assert best_k([even + 1e-9], 1, by_k(ngram_cost)) == 1
    assert best_k([0.95] * 8, 8, by_k(ngram_cost)) == 8


def exhaustive_k(rates, costs, others):
    rate_of = [(1 + others + sum(math.prod(rates[:j]) for j in range(1, k + 1))) / costs[k] for k in range(len(costs))]
    return max(range(len(costs)), key=lambda k: (rate_of[k], -k))  # ties to the smaller k


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=16), st.data(), st.sampled_from([0, 3, 15]))
def test_best_k_reads_draws_lazily_and_still_returns_the_exhaustive_argmax(rates, data, others):
    """best_k stops drawing once no longer k can win, even with costs that are not monotone in k (an engine's
    measured EMAs need not be); its answer is the argmax over every k, and it never reads past what it needs."""
    costs = data.draw(st.lists(st.floats(0.5, 3.0), min_size=len(rates) + 1, max_size=len(rates) + 1))
    read = []

    def draws():
        for r in rates:
            read.append(r)
            yield r

    k = best_k(draws(), len(rates), costs, others)
    full = exhaustive_k(rates, costs, others)
    rate = lambda k: (1 + others + sum(math.prod(rates[:j]) for j in range(1, k + 1))) / costs[k]  # noqa: E731
    assert k == full or math.isclose(rate(k), rate(full), rel_tol=1e-12)  # float ties aside, the same k
    assert len(read) >= k
    # a table longer than k_max (the replay walker's, for its option's k while a round is capped lower):
    # its suffix minimum bounds no higher, so the answer is the same
    longer = costs + data.draw(st.lists(st.floats(0.1, 3.0), max_size=4))
    assert best_k(iter(rates), len(rates), longer, others, suffix_min(longer)) == k


def test_evidence_discounts_by_a_weight_as_eager_discounting_would():
    """Evidence folds each round's discount into one weight; over 10,000 rounds (two refolds at 0.95) its
    counts equal multiplying every position by the discount each round."""
    lazy, eager_h, eager_m = Evidence(4), [0.0] * 4, [0.0] * 4
    rng = random.Random(3)
    for _ in range(10_000):
        proposed, accepted = rng.randint(0, 4), rng.randint(0, 4)
        lazy.discount(DISCOUNT)
        eager_h, eager_m = [h * DISCOUNT for h in eager_h], [m * DISCOUNT for m in eager_m]
        lazy.count(proposed, accepted)
        for j in range(min(proposed, accepted + 1)):
            (eager_h if j < accepted else eager_m)[j] += 1.0
    hits, misses = lazy.values()
    assert hits == pytest.approx(eager_h, rel=1e-9) and misses == pytest.approx(eager_m, rel=1e-9)
    assert lazy.weight < 1e100 and sum(hits) > 1.0


def test_expensive_draft_needs_higher_acceptance_than_ngram():
    def draft_cost(k: int) -> float:
        return FP32[1] if k == 0 else COSTS.forward(k + 1) + 0.02 * k

    assert best_k([0.3] * 4, 4, by_k(ngram_cost)) >= 1
    assert best_k([0.3] * 4, 4, by_k(draft_cost)) == 0


def test_in_a_batched_step_drafts_pay_for_the_time_they_cost_the_other_sequences():
    """The step's committed tokens per second: a draft that pays for a sequence alone (1.3 tokens for 1.1x the
    step) does not pay in a step of 16 whose other sequences wait for the wider forward (16.3 for 1.1x)."""
    def step(k: int) -> float:
        return 1.0 + 0.1 * k

    assert best_k([0.3], 1, by_k(step)) == 1
    assert best_k([0.3], 1, by_k(step), others=15) == 0
    # well accepted drafts that widen the step little still pay: (15 + 4.52) / 1.08 > 16
    assert best_k([0.95] * 4, 4, by_k(lambda k: 1.0 + 0.02 * k), others=15) == 4
    always = beta(k_max=4, prior=(0.3,), cost=step)
    always.base_a, always.base_b = [1e6] * 4, [2.333e6] * 4  # a posterior pinned at 0.3: no sampling noise
    assert always.choose(batch=1) >= 1
    assert always.choose(batch=16) == 0


def run(controller, accept, tokens: int = 256, seed: int = 0) -> float:
    """Tokens per second of ``controller`` on scripted acceptance: ``accept(round, k, rng)`` drafts accepted."""
    rng, spent, done, r = random.Random(1000 + seed), 0.0, 0, 0
    while done < tokens:
        k = controller.choose() if not isinstance(controller, int) else controller
        a = accept(r, k, rng)
        if not isinstance(controller, int):
            controller.observe(k, a)
        spent, done, r = spent + ngram_cost(k), done + a + 1, r + 1
    return done / spent


def bernoulli(p: float):
    def accept(r: int, k: int, rng: random.Random) -> int:
        a = 0
        while a < k and rng.random() < p:
            a += 1
        return a
    return accept


def spans(r: int, k: int, rng: random.Random) -> int:
    return k if r % 60 < 20 else 0  # 20 rounds of a copied span, 40 of new text


@pytest.mark.parametrize("name, accept", [("never", bernoulli(0.0)), ("p0.3", bernoulli(0.3)),
                                          ("p0.6", bernoulli(0.6)), ("p0.9", bernoulli(0.9)),
                                          ("always", bernoulli(1.0)), ("spans", spans)])
def test_within_ten_percent_of_the_best_fixed_k_on_scripted_acceptance(name, accept):
    """The docstring's tuning claim ("near the best fixed k"), as a number: the mean over 50 seeds of tokens/s
    is at least 90% of the best fixed k's (0..8). Over 200 seeds the ratio is 0.92 at p = 0.9 (sd 0.005), 0.93
    at 1, 0.96 at 0.3 and 1.03 on spans; a 50-seed mean has an sd of ~0.01, so ten percent sits 2 sd below the
    worst case (eight percent, 0.92, passed or failed with the controller's random stream)."""
    best = max(statistics.mean(run(k, accept, seed=s) for s in range(50)) for k in range(9))
    mine = statistics.mean(run(beta(seed=s), accept, seed=s) for s in range(50))
    assert mine >= 0.90 * best


def test_perfect_acceptance_drives_k_to_the_maximum():
    c = beta()
    for _ in range(60):
        c.observe(proposed=8, accepted=8)
    assert min(c.means()) > 0.95
    assert statistics.mean(c.choose() for _ in range(50)) > 7


def test_rejections_drive_k_to_zero_and_probes_stay_rare():
    c = beta()
    for _ in range(30):  # every first draft rejected
        c.observe(proposed=4, accepted=0)
    assert c.means()[0] < 0.05
    choices = []
    for _ in range(400):
        k = c.choose()
        choices.append(k)
        c.observe(proposed=k, accepted=0)  # probes keep failing
    # it re-probes, in about one round in five (over 100 seeds: mean 0.20, range 0.18-0.24)
    assert 0.1 * len(choices) < sum(k > 0 for k in choices) < 0.3 * len(choices)
    assert sum(choices) / len(choices) < 1.0


def test_a_probe_that_succeeds_brings_speculation_back():
    recovered = []
    for seed in range(10):
        c = beta(seed=seed)
        for _ in range(30):
            c.observe(proposed=4, accepted=0)
        for r in range(200):
            k = c.choose()
            c.observe(proposed=k, accepted=k)  # the text turned copy-friendly: every draft accepted
            if k == 8:
                break
        recovered.append(r)
    assert statistics.median(recovered) < 50


def test_without_evidence_a_position_returns_to_the_gateways_prior():
    c = beta(k_max=2, prior=(0.6,))
    for _ in range(50):
        c.observe(proposed=2, accepted=0)  # position 1 always rejected, position 2 never reached
    assert c.evidence[0].values()[1][0] == pytest.approx((1 - DISCOUNT ** 50) / (1 - DISCOUNT))  # ~20 rounds
    assert c.means()[0] < 0.05
    for _ in range(200):  # plain rounds: nothing observed
        c.observe(proposed=0, accepted=0)
    assert c.means() == pytest.approx([0.6, 0.6], abs=1e-3)


def test_only_reached_positions_are_counted():
    c = beta(k_max=4)
    c.observe(proposed=4, accepted=1)  # 1 accepted, 2 rejected, 3-4 not reached
    assert list(c.evidence) == [0] and c.evidence[0].values() == ([1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0])


def test_the_gateways_prior_seeds_the_posterior():
    assert beta(prior=(0.9, 0.8)).means() == pytest.approx([0.9] + [0.8] * 7)
    assert beta().posterior() == ([PRIOR_STRENGTH * 0.5] * 8, [PRIOR_STRENGTH * 0.5] * 8)
    hopeful, hopeless = beta(prior=(0.95,), seed=1), beta(prior=(0.02,), seed=1)
    assert statistics.mean(hopeful.choose() for _ in range(50)) > 4
    assert statistics.mean(hopeless.choose() for _ in range(50)) < 1


def test_same_seed_same_choices():
    a, b = beta(seed=7), beta(seed=7)
    assert [a.choose() for _ in range(50)] == [b.choose() for _ in range(50)]


def test_controller_for_shares_sglang_per_proposer_and_k():
    shared: dict = {}
    ng = SpeculationParams(proposer="ngram", draft_tokens=7, adaptive=True, strategy="sglang")
    first = controller_for(ng, NGRAM_BY_K, 0, shared)
    assert controller_for(ng, NGRAM_BY_K, 1, shared) is first
    other = SpeculationParams(proposer="draft_model", draft_tokens=7, adaptive=True, strategy="sglang")
    assert controller_for(other, NGRAM_BY_K, 0, shared) is not first
    mine = SpeculationParams(proposer="ngram", draft_tokens=7, adaptive=True, prior=(0.7,))
    assert isinstance(controller_for(mine, NGRAM_BY_K, 0, shared), BetaDraftLength)
    assert set(shared) == {("sglang", "ngram", 7), ("sglang", "draft_model", 7), ("pooled", "ngram")}


def test_bad_strategy_and_table_are_refused():
    with pytest.raises(ValueError, match="strategy must be one of beta, sglang, vllm"):
        SpeculationParams(proposer="ngram", adaptive=True, strategy="eagle")
    with pytest.raises(ValueError, match="k_by_batch must be ascending"):
        SpeculationParams(proposer="ngram", adaptive=True, strategy="vllm", k_by_batch=((4, 2), (1, 8)))
    with pytest.raises(ValueError, match="prior must be"):
        SpeculationParams(proposer="ngram", adaptive=True, prior=(1.5,))


def test_engine_runs_each_controller_and_reports_what_it_chose(real_tokenizer):
    """Greedy output identical to plain under every controller; ``chosen_per_k`` counts the rounds per draft
    length asked for; vLLM's table reads the batch (2 running -> k 3); SGLang's state is shared and stepped
    once per engine step."""
    from backends.engine.types import GenerateRequest, SamplingParams
    from tests.engine.engine_helpers import make_tiny_engine, run_all

    engine = make_tiny_engine(real_tokenizer, seed=3)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=30)
    prompt = (5, 6, 7, 5, 6, 7, 5, 6)
    specs = {"beta": SpeculationParams(proposer="ngram", draft_tokens=8, adaptive=True),
             "sglang": SpeculationParams(proposer="ngram", draft_tokens=7, adaptive=True, strategy="sglang"),
             "vllm": SpeculationParams(proposer="ngram", draft_tokens=6, adaptive=True, strategy="vllm",
                                       k_by_batch=((1, 5), (2, 3)))}
    plain = run_all(engine, [GenerateRequest(rid="plain", input_ids=prompt, sampling=sampling)])["plain"][-1]
    for name, spec in specs.items():
        out = run_all(engine, [GenerateRequest(rid=name, input_ids=prompt, sampling=sampling, speculation=spec),
                               GenerateRequest(rid="other", input_ids=prompt, sampling=sampling)])[name][-1]
        assert out.output_ids == plain.output_ids, name
        chosen = out.stats.chosen_per_k
        assert sum(chosen) == out.stats.verify_ct, name
        if name == "vllm":  # two running: k 3, fewer only where the n-gram found fewer or tokens ran out
            assert len(chosen) == 4 and out.stats.num_proposed_drafts == sum(k * n for k, n in enumerate(chosen))
    shared = engine.slot_maker.shared_controllers[("sglang", "ngram", 7)]
    assert shared.batches > 0 and shared.steps == [1, 3, 7]


def test_match_length_buckets():
    assert [match_context(n) for n in (0, 1, 2, 3, 4, 7, 8, 12)] == [0, 1, 2, 3, 4, 4, 8, 8]


def test_acceptance_is_learned_per_context_and_k_follows_the_context():
    c = beta(seed=1)
    for _ in range(40):
        c.observe(8, 8, context=8)  # long matches: every draft accepted
        c.observe(8, 0, context=1)  # one-token matches: the first draft rejected
    assert min(c.means(8)) > 0.9 and c.means(1)[0] < 0.1
    assert statistics.mean(c.choose(context=8) for _ in range(30)) > 7
    assert statistics.mean(c.choose(context=1) for _ in range(30)) < 1
    assert c.choose(context=8, cap=3) <= 3 and c.choose(context=8, cap=0) == 0


def test_a_new_sequence_starts_from_the_engines_pooled_acceptance():
    pooled = PooledAcceptance()
    old = BetaDraftLength(k_max=4, round_costs=NGRAM_BY_K, pooled=pooled)
    for _ in range(300):  # more than POOL_STRENGTH rounds in each context (discounted by POOL_DISCOUNT)
        old.observe(4, 4, context=8)
        old.observe(4, 0, context=1)
    new = BetaDraftLength(k_max=4, round_costs=NGRAM_BY_K, pooled=pooled)
    alpha, beta_ = new.posterior(8)
    assert alpha[0] + beta_[0] == pytest.approx(PRIOR_STRENGTH + POOL_STRENGTH)  # pooled weight capped
    assert new.means(8)[0] > 0.9 and new.means(1)[0] < 0.1 and new.means(2) == [0.5] * 4  # 2: never seen
    assert new.evidence == {}  # its own evidence starts empty


def test_ngram_proposal_reports_its_match_length():
    from backends.engine.proposers.ngram import NgramProposer
    from backends.engine.types import SamplingParams

    p = NgramProposer(1, 12)
    context = [1, 2, 3, 4, 9, 1, 2, 3]  # suffix [1, 2, 3] occurred at the start: 3 tokens, then 4, 9, ...
    got = p.propose(context, 4, SamplingParams(), None, None)
    assert (got.tokens, got.match) == ([4, 9, 1, 2], 3)


# A step of 4 sequences priced by total tokens, as measured on a 2-core AVX-512 Xeon (docs/runs/layout/xeon/
# calibrate.txt, 4 sequences at context 32: 1 / 2 / 3 / 5 tokens each 43.1 / 55.1 / 61.1 / 58.2 ms): 20 rows
# cost less than 12 (MKL's GEMM gets efficient from ~16 rows), linear in between
XEON_4 = {4: 0.0431, 8: 0.0551, 12: 0.0611, 20: 0.0582}


def xeon_4(tokens: float) -> float:
    points = sorted(XEON_4)
    below = max(t for t in points if t <= tokens)
    above = min(t for t in points if t >= tokens)
    if below == above:
        return XEON_4[below]
    return XEON_4[below] + (tokens - below) / (above - below) * (XEON_4[above] - XEON_4[below])


def test_plan_step_finds_the_wide_step_that_no_sequence_pays_for_alone():
    gains = [0.6, 0.36, 0.216, 0.1296]  # theta = 0.6 at every position: prod_{i<=j} theta_i
    # each sequence alone, the other three feeding one token: the best k is 2 ((4 + 0.96) / 49.1 ms)
    costs = [xeon_4(4 + k) for k in range(5)]
    assert best_k([0.6] * 4, 4, costs, others=3.0) == 2
    # together: 4 drafts each, 20 rows, (4 + 4 x 1.31) / 58.2 ms, against (4 + 4 x 0.96) / 61.1 at 2 each
    assert plan_step([gains] * 4, 4.0, lambda w: xeon_4(4 + w)) == [4, 4, 4, 4]


def test_plan_step_gives_drafts_to_the_largest_gains_and_breaks_ties_toward_fewer():
    linear = lambda w: 1.0 + 0.1 * w  # a draft costs 0.1 of a step: worth it when it adds more than ~0.1 x rate
    plan = plan_step([[0.9, 0.85, 0.5], [0.3], [0.95, 0.2]], 3.0, linear)
    # rate by W over the sorted gains 0.95 0.9 0.85 0.5 0.3 0.2: 3.00 3.59 4.04 4.38 4.43 4.33 4.19 -> W = 4
    assert plan == [3, 0, 1]
    assert plan_step([[0.5], [0.5]], 2.0, lambda w: 1.0 + 0.25 * w) == [0, 0]  # 2.5 / 1.25 = 2.0: a tie
    assert plan_step([[], []], 2.0, linear) == [0, 0]


def test_gains_are_the_draws_survival_products_and_stop_below_the_floor():
    controller = BetaDraftLength(k_max=8, round_costs=lambda k: [1.0] * (k + 1), seed=3)
    twin = BetaDraftLength(k_max=8, round_costs=lambda k: [1.0] * (k + 1), seed=3)
    gains = controller.gains(0, cap=5)
    draws = list(twin._draws(0, 5))
    expected = list(itertools.accumulate(draws, operator.mul))
    expected = expected[:next((j for j, g in enumerate(expected) if g < GAIN_FLOOR), len(expected))]
    assert gains == pytest.approx(expected, rel=1e-12) and len(gains) <= 5
    assert controller.gains(0, cap=0) == []
