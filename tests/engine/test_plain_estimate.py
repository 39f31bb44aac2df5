"""The engine's counterfactual: what each round would have cost as a plain step (``RoundStats.plain_s``), and the
request's ``plain_ratio`` that the worker reports as ``specgate_plain_ratio`` and the gateway's auto learns plain
decoding's TPOT from (policies/auto.py); and what a round's drafts cost the other sequences of its step
(``RoundStats.neighbour_s``, reported as ``specgate_neighbour_s``, charged by auto). Tiny random model with a fixed step-cost model (FrozenCosts), so the
step-cost model's ratio for a round's drafts is known exactly."""

from __future__ import annotations

import pytest

from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from tests.engine.engine_helpers import FrozenCosts, RoundLog, final, make_tiny_engine, run_all

PROMPT = (5, 6, 7, 5, 6, 7, 5, 6)  # the seeded tiny model (seed 3) falls into a loop: n-gram drafts get accepted
TOKEN_S = 1e-5  # FrozenCosts' seconds per token: k drafts add k * TOKEN_S to a one-sequence forward


@pytest.fixture()
def engine(real_tokenizer):
    engine = make_tiny_engine(real_tokenizer, seed=3)
    engine.costs = FrozenCosts(base_s=0.02, token_s=TOKEN_S)
    return engine


def request(rid: str, speculation: SpeculationParams = SpeculationParams()) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=PROMPT, sampling=SamplingParams(temperature=0.0, max_new_tokens=40),
                           speculation=speculation)


def frozen_forward(tokens: int) -> float:
    return 0.02 + TOKEN_S * tokens  # FrozenCosts(base_s=0.02, token_s=TOKEN_S), one sequence per step here


def test_a_rounds_plain_counterfactual_is_its_forward_scaled_to_the_step_without_its_drafts(engine, monkeypatch):
    log = RoundLog(monkeypatch)
    out = final(engine, request("s", SpeculationParams(proposer="ngram", draft_tokens=4)))
    rounds = log.of(out)
    assert out.stats.num_correct_drafts > 0
    for r in rounds:  # the round fed 1 + k tokens; plain would have fed 1
        want = r.verify_s * frozen_forward(1) / frozen_forward(1 + r.k) + r.overhead_s
        assert r.plain_s == pytest.approx(want, rel=1e-9, abs=1e-12)
    stats = out.stats
    spent = sum(r.draft_s + r.verify_s + r.overhead_s for r in rounds)
    assert stats.verify_ct == len(rounds) < stats.completion_tokens == 40
    assert stats.plain_ratio == pytest.approx(40 * sum(r.plain_s for r in rounds) / (len(rounds) * spent), rel=1e-9)
    # 40 tokens in fewer rounds, each costing about what a plain step does (drafts add microseconds here)
    assert stats.plain_ratio > 1.0


def test_a_request_that_never_drafts_reports_a_ratio_of_one(engine):
    out = final(engine, request("p"))
    assert out.stats.verify_ct == out.stats.completion_tokens == 40
    assert out.stats.plain_ratio == pytest.approx(1.0, rel=1e-9)


def test_a_rounds_drafts_are_charged_to_it_once_for_every_other_sequence_of_its_step(engine, monkeypatch):
    """Two requests decoding side by side: each round with drafts charges (sequences - 1) x (its forward less
    its plain share + its drafting); alone, or without drafts, nothing."""
    log = RoundLog(monkeypatch)
    spec = SpeculationParams(proposer="ngram", draft_tokens=4)
    events = run_all(engine, [request("a", spec), request("b", spec)])
    a, b = events["a"][-1], events["b"][-1]
    assert a.output_ids == b.output_ids  # the same prompt, greedy: the same rounds, in the same steps
    rounds = log.of(a)
    drafted = [r for r in rounds if r.k]
    assert drafted and all(r.neighbour_s > 0 for r in drafted)
    for r in rounds:  # one other sequence in every step (both finish in the same one)
        want = 1 * (r.verify_s - (r.plain_s - r.overhead_s) + r.draft_s) if r.k else 0.0
        assert r.neighbour_s == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert a.stats.neighbour_s == pytest.approx(sum(r.neighbour_s for r in rounds), rel=1e-12)
    alone = final(engine, request("c", spec))
    assert alone.stats.num_proposed_drafts > 0 and alone.stats.neighbour_s == 0.0
