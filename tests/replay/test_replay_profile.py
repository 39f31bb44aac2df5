"""The replay's per-request profile and the price of an engine step (replay/profile.py): each round's
shape and its seconds outside the forward, counted as the worker counts them, and a step's forward priced as
one batch of its rounds plus its prefill chunks. Expected values are written out from the hand-made cost
model of test_replay_sim.py (sim_helpers.py)."""

from __future__ import annotations

import msgspec
import pytest

from backends.engine.types import RequestStats, RoundStats
from replay.book import PLAIN, Option
from replay.profile import profile, step_s
from tests.replay.sim_helpers import (COSTS, DRAFT_CALL, DRAFT_TOKEN, NGRAM_CALL, NGRAM_SETUP, OVERHEAD, TIGHT,
                                       batched, forward, prefill)


def test_profile_gives_each_rounds_shape_and_seconds_outside_the_forward_and_counts_as_the_worker():
    # 600-token prompt: the 600th is the first round's. Rounds (ngram, k = 4, output 13 tokens): a full
    # accept, a short draft, no draft with a budget, 3 of 4, and the last token with budget 0 (no propose call)
    rounds = ((4, 2, 0, 4, 0), (4, 1, 0, 3, 0), (4, 4, 4, 4, 0))
    p = profile(COSTS, 600, 13, Option("ngram", 4), rounds)
    contexts = (599, 604, 606, 607, 611)  # prompt - 1 + committed before the round (5, 2, 1, 4 committed)
    assert p.prompt_len == 600
    assert p.fed == (5, 3, 1, 5, 1)
    assert p.context == contexts
    assert p.serial == pytest.approx([600 * NGRAM_SETUP + NGRAM_CALL + OVERHEAD,  # the first draft indexes
                                      NGRAM_CALL + OVERHEAD, NGRAM_CALL + OVERHEAD, NGRAM_CALL + OVERHEAD,
                                      OVERHEAD], rel=TIGHT)
    assert (p.tokens, p.verify_ct, p.accepted) == (13, 5, 8)
    assert p.draft_s == pytest.approx(600 * NGRAM_SETUP + 4 * NGRAM_CALL, rel=TIGHT)
    assert p.verify_s == pytest.approx(sum(forward(d + 1, c) for d, c in zip(rounds[0], contexts)), rel=TIGHT)

    stats = RequestStats()  # the same rounds as the worker records them
    for drafted, accepted, budget in zip(*rounds):
        stats.record(RoundStats(k=drafted, accepted=accepted, budget=budget, committed=accepted + 1,
                                bonus=accepted == drafted > 0, draft_s=0.0, verify_s=0.0, overhead_s=0.0))
    assert list(p.histogram) == stats.correct_drafts_histogram == [2, 1, 0, 1, 1]
    assert list(p.reached_per_position) == stats.reached_per_position == [4, 3, 2, 2]
    assert list(p.accepted_per_position) == stats.accepted_per_position == [3, 2, 2, 1]


def test_profile_of_a_draft_model_pays_per_drafted_token():
    rounds = ((2, 2), (1, 2), (2, 2))
    p = profile(COSTS, 10, 4, Option("draft_model", 2, "0123456789ab"), rounds)
    assert (p.fed, p.context) == ((3, 3), (9, 11))
    assert p.serial == pytest.approx([DRAFT_CALL + 2 * DRAFT_TOKEN + OVERHEAD] * 2, rel=TIGHT)


def test_the_serving_cost_is_paid_once_per_round_and_not_in_the_engine_figures():
    serving = 0.029
    costs = msgspec.structs.replace(COSTS, serving_s=serving)
    rounds = ((0, 0), (0, 0), (0, 0))
    p = profile(costs, 10, 2, PLAIN, rounds)
    q = profile(COSTS, 10, 2, PLAIN, rounds)
    assert [a - b for a, b in zip(p.serial, q.serial)] == pytest.approx([serving, serving], rel=TIGHT)
    assert (p.draft_s, p.verify_s) == (q.draft_s, q.verify_s)  # what the worker reports is the engine's alone


def test_a_step_prices_its_rounds_as_one_forward_of_the_batch_and_adds_its_prefill_chunks():
    rounds, chunks = [(1, 100), (5, 300)], [(64, 0)]
    # measured at batch 1 only: the engine before batching, one forward per sequence: the sum
    assert step_s(COSTS, rounds, []) == pytest.approx(forward(1, 100) + forward(5, 300), rel=TIGHT)
    assert step_s(COSTS, [], chunks) == pytest.approx(prefill(64, 0), rel=TIGHT)
    # measured at 1 and 4: 4 rounds cost 1.6x one (the mean of four 4-sequence forwards at their own shapes)
    four = [(1, 100), (5, 300), (1, 0), (9, 50)]
    assert step_s(batched(1.6), four, []) == pytest.approx(1.6 * sum(forward(*r) for r in four) / 4, rel=TIGHT)
    # two rounds: linear between batch 1 and batch 4, a third of the way
    assert step_s(batched(1.6), rounds, chunks) == pytest.approx(
        1.2 * (forward(1, 100) + forward(5, 300)) / 2 + prefill(64, 0), rel=TIGHT)
    # above the largest measured batch: proportional (8 sequences = two forwards of 4)
    assert step_s(batched(1.6), four * 2, []) == pytest.approx(2 * 1.6 * sum(forward(*r) for r in four) / 4,
                                                               rel=TIGHT)
    assert step_s(COSTS, [], []) == 0.0


