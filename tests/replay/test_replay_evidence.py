"""Full-information evidence (replay/evidence.py): the rounds of every fixed model-free option on a served greedy
answer are the engine's own, priced as replay prices a TPOT, and the learner counts them as observations of
those options, so auto knows an option it never served."""

from __future__ import annotations

import random

import pytest

from backends.engine.counterfactual import Recorded, replay
from backends.engine.types import SpeculationParams
from policies.auto import CounterfactualOption, counterfactual_options
from policies.decide import decide
from policies.features import RequestFeatures
from policies.load import load_policy
from policies.snapshot import PoolState
from policies.stats import LearningState, Outcome, with_counterfactuals
from replay.book import Option
from replay.evidence import Counterfactuals, charged_s
from tests.replay.replay_helpers import CODE_RATIO, PHRASE, PROSE_RATIO, costs


def test_an_ngram_option_is_priced_as_replay_prices_its_tpot():
    """The replay CLI tests' hand-computed TPOTs: n-gram k=4 on the phrase-copying request runs 3 rounds
    (5, 5, 2 tokens), on the prose request 12 rounds that draft nothing but pay the propose call."""
    evidence = Counterfactuals()
    option = [CounterfactualOption("ngram@4#v", "ngram", 4)]
    code, _ = evidence.ratios(costs(), PHRASE * 3, PHRASE * 2, 12, "default", 1, option)
    prose, _ = evidence.ratios(costs(), list(range(1, 19)), list(range(31, 43)), 12, "default", 1, option)
    assert code == {"ngram@4#v": pytest.approx(CODE_RATIO, rel=1e-12)}
    assert prose == {"ngram@4#v": pytest.approx(PROSE_RATIO, rel=1e-12)}
    assert CODE_RATIO < 1 < PROSE_RATIO


def test_the_served_options_own_ratio_comes_back_beside_the_others():
    evidence = Counterfactuals()
    ratios, own = evidence.ratios(costs(), PHRASE * 3, PHRASE * 2, 12, "default", 1,
                                  [CounterfactualOption("ngram@2#v", "ngram", 2)], served=("ngram", 4))
    assert own == pytest.approx(CODE_RATIO, rel=1e-12)
    assert set(ratios) == {"ngram@2#v"} and ratios["ngram@2#v"] != own


def test_a_wider_step_charges_the_drafts_to_the_neighbours():
    """At batch 4 a round of 5 tokens widens the step the three others wait for: engine-seconds per token grow
    with the batch for the same rounds (the forward here costs 1 ms a token whatever the batch)."""
    rounds = ((4, 4, 1), (4, 4, 1), (0,) * 3)
    alone = charged_s(costs(), 18, 12, Option("ngram", 4), ((4, 4, 1), (4, 4, 1), (4, 4, 1)), 1)
    shared = charged_s(costs(), 18, 12, Option("ngram", 4), ((4, 4, 1), (4, 4, 1), (4, 4, 1)), 4)
    assert shared > alone
    assert rounds  # the shape the engine reports: (drafted, accepted, budget) per round


def records() -> list[Recorded]:
    """Three answers that repeat each other's text (suffix drafts from the earlier ones) and their prompts."""
    a = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
    return [Recorded(prompt=(1, 2, 3), output=tuple(a), max_new_tokens=12, scope="r"),
            Recorded(prompt=(4, 5, 6), output=tuple(a[:6] + [60, 61] + a[6:10]), max_new_tokens=12, scope="r"),
            Recorded(prompt=(7, 8, 9), output=tuple(a), max_new_tokens=12, scope="r")]


def test_suffix_options_see_every_earlier_answer_once_whatever_was_asked():
    """Asking for two suffix draft lengths (and n-gram) on each answer gives the rounds the engine's own suffix
    proposer runs over the stream in order: each evaluation is taken out of the tree again and the answer
    joins it once, after its own options."""
    evidence = Counterfactuals()
    got = [evidence.rounds(r.prompt, r.output, r.max_new_tokens, r.scope, [("suffix", 4), ("ngram", 4), ("suffix", 8)])
           for r in records()]
    for k in (4, 8):
        want = replay(records(), SpeculationParams(proposer="suffix", draft_tokens=k))
        assert [(g["suffix", k][0], g["suffix", k][1]) for g in got] == [(w.drafted, w.accepted) for w in want]
    # the third answer is the first one again, drafted from the tree (a draft is at most as long as its match,
    # max_spec_factor 1: rounds of 0, 1, 3, 4 accepted drafts)
    assert got[2]["suffix", 8][1] == (0, 1, 3, 4)
    ngram = replay(records(), SpeculationParams(proposer="ngram", draft_tokens=4))
    assert [(g["ngram", 4][0], g["ngram", 4][1]) for g in got] == [(w.drafted, w.accepted) for w in ngram]


def test_an_answer_joins_the_tree_even_when_no_suffix_option_was_asked():
    evidence = Counterfactuals()
    first, second = records()[0], records()[2]
    evidence.rounds(first.prompt, first.output, 12, "r", [("ngram", 4)])
    again = evidence.rounds(second.prompt, second.output, 12, "r", [("suffix", 8)])
    assert again["suffix", 8][1] == (0, 1, 3, 4)  # drafted from the first answer's copy in the tree
    other_scope = Counterfactuals()
    other_scope.rounds(first.prompt, first.output, 12, "elsewhere", [("ngram", 4)])
    assert sum(other_scope.rounds(second.prompt, second.output, 12, "r", [("suffix", 8)])["suffix", 8][1]) == 0
    assert sum(Counterfactuals().rounds(second.prompt, second.output, 12, "r", [("suffix", 8)])["suffix", 8][1]) == 0


POLICY = """
version: 1
slices: [{name: prose}]
pairs:
  ng: {target: {model: m, revision: r1}, draft: {kind: ngram}}
  sx: {target: {model: m, revision: r1}, draft: {kind: suffix}}
pools:
  plain: {proposer: none, workers: ["http://w:1"], speculation: per_request}
  ngram: {proposer: ngram, draft_tokens: {min: 2, max: 4}, pair: ng, workers: ["http://w:1"], speculation: per_request}
  adaptive: {proposer: ngram, draft_tokens: 8, adaptive: true, pair: ng, workers: ["http://w:1"], speculation: per_request}
  suffix: {proposer: suffix, draft_tokens: 8, pair: sx, workers: ["http://w:1"], speculation: per_request}
rules: [{name: learned, then: auto}]
"""
HEALTHY = {name: PoolState(healthy=True, pair_verified=True) for name in ("plain", "ngram", "adaptive", "suffix")}


def test_the_options_a_request_can_teach_are_the_fixed_model_free_ones_it_did_not_get():
    p = load_policy(POLICY, "p.yaml")
    versions = {name: p.pool_pair_version(name) for name in p.pools}
    got = counterfactual_options(p, ("ngram", "adaptive", "suffix"), versions, ("ngram", 4))
    assert [(o.proposer, o.k) for o in got] == [("ngram", 2), ("suffix", 8)]
    assert got[1].label == f"suffix@8#{versions['suffix']}"
    d = decide(p, RequestFeatures(max_tokens=64), LearningState(p.learning).snapshot(0.0, HEALTHY, 1))
    assert (d.pool, d.bypass) == ("plain", True)  # cold: plain is served first
    assert {(o.proposer, o.k) for o in d.counterfactual} == {("ngram", 2), ("ngram", 4), ("suffix", 8)}


def test_counterfactual_evidence_makes_an_option_known_without_serving_it():
    """One plain request that carries the evidence of every fixed option: none of them is cold any more, and
    the one its evidence says is fastest is chosen on the posterior mean (no exploration)."""
    p = load_policy(POLICY, "p.yaml")
    state = LearningState(p.learning)
    d = decide(p, RequestFeatures(max_tokens=64), state.snapshot(0.0, HEALTHY, 1), rng=random.Random(0))
    ratios = {o.label: {2: 0.8, 4: 0.7, 8: 0.5}[o.k] for o in d.counterfactual}
    served = Outcome(route="default", slice="prose", pool="plain", completion_tokens=64, tpot_s=0.04, timestamp=1.0)
    o = with_counterfactuals(served, ratios, None)
    assert o.counterfactual == {label: pytest.approx(0.04 * r) for label, r in ratios.items()}
    state.record(o)
    snap = state.snapshot(1.0, HEALTHY, 1)
    for label in ratios:
        assert snap.arm_ever("prose", label) == 1.0 and snap.arm_ever("prose", label, table="gaps") == 1.0
    # the adaptive pool cannot be evaluated from ids: it is the one option still served cold
    d = decide(p, RequestFeatures(max_tokens=64), snap, rng=random.Random(0))
    assert (d.pool, d.exploration) == ("adaptive", "cold")
    # once it has been served (slower than suffix's evidence), the posterior mean picks suffix
    state.record(Outcome(route="default", slice="prose", pool="adaptive", pair_version=p.pool_pair_version("adaptive"),
                         proposer="ngram", draft_tokens=8, completion_tokens=64, tpot_s=0.035, plain_tpot_s=0.04,
                         timestamp=2.0))
    d = decide(p, RequestFeatures(max_tokens=64), state.snapshot(2.0, HEALTHY, 1))
    assert (d.pool, d.draft_tokens, d.exploration) == ("suffix", 8, None)


def test_a_server_without_a_plain_estimate_gets_one_from_the_served_options_price():
    """An SGLang pool reports no plain estimate; a fixed n-gram answer's own price ratio gives it, and the
    others' evidence is relative to it."""
    o = Outcome(route="default", slice="prose", pool="ngram", proposer="ngram", draft_tokens=4, completion_tokens=64,
                tpot_s=0.03)
    got = with_counterfactuals(o, {"suffix@8#v": 0.5}, served_ratio=0.75)
    assert got.plain_tpot_s == pytest.approx(0.04)
    assert got.counterfactual == {"suffix@8#v": pytest.approx(0.02)}
    assert with_counterfactuals(o, {"suffix@8#v": 0.5}, served_ratio=None) == o  # nothing to anchor it to
