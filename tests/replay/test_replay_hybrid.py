"""The hybrid proposer in replay (replay/hybrid.py): its walker runs the rounds the engine's proposer object runs,
round for round (counterfactual.replay_request drives the engine's HybridProposer; tests/engine/test_counterfactual.py
proves that equal to the engine on the real model), fixed and with the beta controller; and the oracle over both
sources is never slower than either source alone."""

from __future__ import annotations

import random

import pytest

from backends.engine.counterfactual import Recorded, replay, replay_request
from backends.engine.proposers.hybrid import HybridProposer
from backends.engine.proposers.ngram import NgramProposer
from backends.engine.proposers.suffix import SuffixStore
from backends.engine.source_choice import rule_for
from backends.engine.types import SpeculationParams
from replay.book import Option
from replay.choosers import RunState
from replay.run import parse_arm
from tests.replay.sim_helpers import prices_of, request, simulate


def stream() -> list:
    """Requests of one scope whose outputs copy their prompts (n-gram's drafts accepted), repeat an earlier
    output (suffix's global tree accepted), or both in turn, or neither."""
    rng = random.Random(5)
    fresh = lambda n: rng.sample(range(1000, 30000), n)  # noqa: E731
    a, b, c, d = fresh(200), fresh(200), fresh(200), fresh(200)
    answer = fresh(40)
    return [request(0, 0, rid="copy", prompt=a, output=a[50:90] + fresh(10)),
            request(0, 0, rid="new", prompt=b, output=answer + fresh(8)),
            request(0, 0, rid="again", prompt=c, output=answer[:30] + fresh(6) + answer[30:]),
            request(0, 0, rid="both", prompt=d, output=d[20:45] + answer[5:35] + d[100:120]),
            request(0, 0, rid="none", prompt=fresh(100), output=fresh(30))]


def walked(prices, option: Option) -> list[tuple[list[int], list[int]]]:
    """Each request's (drafted, accepted) per round, walked alone one after another (c1), in order."""
    run, shared, out = RunState(0), {}, []
    for i in range(len(prices.book.requests)):
        walker = prices.profile(i, option, run)[0]
        walker.bind(shared)
        while not walker.finished:
            walker.next_round(1)
        out.append((walker.drafted, walker.accepted))
    return out


def records(prices) -> list[Recorded]:
    return [Recorded(tuple(r.prompt_ids), tuple(r.output_ids), r.sampling.max_new_tokens, r.route)
            for r in prices.book.requests]


@pytest.mark.parametrize("k", [4, 8, 16])
def test_the_fixed_hybrid_walker_runs_the_counterfactual_rounds(k):
    prices = prices_of(*stream())
    want = replay(records(prices), SpeculationParams(proposer="hybrid", draft_tokens=k))
    got = walked(prices, Option("hybrid", k))
    assert got == [(list(r.drafted), list(r.accepted)) for r in want]
    assert [sum(accepted) > 0 for _, accepted in got] == [True, False, True, True, False]  # new text: nothing


def test_the_beta_hybrid_walker_runs_the_engines_rule_round_for_round():
    """The engine's HybridProposer with the walker's seeds and cost tables, one after another on one pooled
    acceptance, drafts and accepts what the walker does."""
    prices = prices_of(*stream())
    option = Option("hybrid", 16, strategy="beta")
    store, shared, want = SuffixStore(), {}, []
    for i, record in enumerate(records(prices)):
        table = prices.costs.round_costs("hybrid", 16, len(record.prompt), 1)
        seed = random.Random(f"controller:0:{i}").getrandbits(63)
        rule = rule_for(SpeculationParams(proposer="hybrid", draft_tokens=16, adaptive=True), lambda k: table, seed,
                        shared)
        proposer = HybridProposer(NgramProposer(), store.open(record.scope, list(record.prompt)), rule)
        result = replay_request(proposer, record, 16)
        want.append((list(result.drafted), list(result.accepted)))
    assert walked(prices, option) == want
    assert {d for drafted, _ in want for d in drafted} - {0, 16}  # it chose k below the cap too


def test_the_oracle_over_both_sources_is_never_slower_than_either_alone():
    prices = prices_of(*stream())
    order = [list(range(len(prices.book.requests)))]
    tpot = {}
    for arm in ("hybrid-k16-oracle", "ngram-k16-oracle", "suffix-k16", "hybrid-k16", "hybrid-k16-beta"):
        served = simulate(prices, "c1", order, option=parse_arm(arm, prices.book).option)
        tpot[arm] = sum(s.tpot for s in served.values())
    assert tpot["hybrid-k16-oracle"] <= min(tpot["ngram-k16-oracle"], tpot["suffix-k16"], tpot["hybrid-k16"],
                                           tpot["hybrid-k16-beta"]), tpot
    assert tpot["hybrid-k16-oracle"] < tpot["ngram-k16-oracle"]  # suffix's repeated answers are its to win


def test_hybrid_arms_parse_and_the_informed_reference_stays_ngram_only():
    book = prices_of(*stream()).book
    assert parse_arm("hybrid-k8", book).option == Option("hybrid", 8)
    assert parse_arm("hybrid-k16-beta", book).option == Option("hybrid", 16, strategy="beta")
    assert parse_arm("hybrid-k16-oracle", book).option == Option("hybrid", 16, strategy="oracle")
    with pytest.raises(ValueError, match="^--arms hybrid-k8-informed: the references"):
        parse_arm("hybrid-k8-informed", book)


def test_the_oracles_halves_know_one_choice_each():
    """``=k`` serves the rule's source cut at its accepted run, so no round drafts a rejected token; ``=source``
    serves the source with the longer run at the rule's k. Each knows less than the whole oracle."""
    prices = prices_of(*stream())
    book = prices.book
    assert parse_arm("hybrid-k16-oracle=k", book).option == Option("hybrid", 16, strategy="oracle", features="k")
    assert parse_arm("hybrid-k16-oracle=source", book).option.features == "source"
    with pytest.raises(ValueError, match="halves are hybrid-kN-oracle=source and hybrid-kN-oracle=k"):
        parse_arm("hybrid-k16-oracle=match", book)
    with pytest.raises(ValueError, match="is not an arm"):
        parse_arm("suffix-k16-oracle=k", book)
    cut = walked(prices, Option("hybrid", 16, strategy="oracle", features="k"))
    assert all(d == a for drafted, accepted in cut for d, a in zip(drafted, accepted))
    assert sum(sum(accepted) for _, accepted in cut) > 0
    # =source: every round's accepted tokens are as many as the longer run allows within what it drafted
    run, shared, rounds = RunState(0), {}, 0
    for i in range(len(book.requests)):
        walker = prices.profile(i, Option("hybrid", 16, strategy="oracle", features="source"), run)[0]
        walker.bind(shared)
        while not walker.finished:
            longest = max(r for _, r, _ in walker._drafts()[1])
            walker.next_round(1)
            assert walker.accepted[-1] == min(walker.drafted[-1], longest)
            rounds += walker.drafted[-1] > 0
    assert rounds > 10
    order = [list(range(len(book.requests)))]
    tpot = {arm: sum(s.tpot for s in simulate(prices, "c1", order, option=parse_arm(arm, book).option).values())
            for arm in ("hybrid-k16-oracle", "hybrid-k16-oracle=k", "hybrid-k16-oracle=source")}
    # the whole oracle breaks ties of equal runs toward suffix (its draft costs more): =k may match it to 0.1%
    assert tpot["hybrid-k16-oracle"] < tpot["hybrid-k16-oracle=source"], tpot
    assert tpot["hybrid-k16-oracle=k"] == pytest.approx(tpot["hybrid-k16-oracle"], rel=1e-3)
