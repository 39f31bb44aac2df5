"""The gateway's full-information evidence (gateway/evidence.py): which requests carry it, that their outcomes reach
the learner with it, in the order they finished, and that nothing in it can lose an outcome."""

from __future__ import annotations

import asyncio

import pytest

from policies.auto import CounterfactualOption
from policies.decide import Decision
from policies.stats import Outcome
from gateway.evidence import GatewayEvidence, wanted
from telemetry.core import Telemetry
from gateway.telemetry_views import policy_view
from policies.load import load_policy
from tests.replay.replay_helpers import CODE_RATIO, PHRASE, costs

OPTION = CounterfactualOption("ngram@4#v", "ngram", 4)
PLAIN = Decision(slice="code", pool="plain", proposer="none", draft_tokens=0, bypass=True, rule="learned",
                 reason="r", counterfactual=(OPTION,))


def served(rid: int) -> Outcome:
    return Outcome(route="default", slice="code", pool="plain", completion_tokens=12, tpot_s=0.02,
                   timestamp=float(rid))


def test_only_greedy_requests_whose_rule_offers_options_want_evidence():
    assert wanted(PLAIN, {"temperature": 0})
    assert not wanted(PLAIN, {"temperature": 0.7})
    assert not wanted(PLAIN, {})  # OpenAI's default temperature is 1: sampled
    assert not wanted(Decision(slice="code", pool="plain", proposer="none", draft_tokens=0, bypass=True, rule="r",
                               reason="r"), {"temperature": 0})
    assert not wanted(None, {"temperature": 0})


async def learned_outcomes(evidence: GatewayEvidence, jobs: list[tuple]) -> list[Outcome]:
    got: list[Outcome] = []
    for outcome, prompt, output in jobs:
        evidence.submit(outcome, PLAIN, "http://w:1", prompt, output, 12, got.append)
    while len(got) < len(jobs):
        await asyncio.sleep(0.01)
    return got


def test_outcomes_reach_the_learner_with_their_evidence_in_the_order_they_finished():
    evidence = GatewayEvidence(lambda url: costs())
    jobs = [(served(i), PHRASE * 3, PHRASE * 2) for i in range(5)]
    got = asyncio.run(learned_outcomes(evidence, jobs))
    evidence.close()
    assert [o.timestamp for o in got] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert all(o.counterfactual == {"ngram@4#v": pytest.approx(0.02 * CODE_RATIO)} for o in got)


def test_without_ids_or_a_cost_model_or_on_an_error_the_outcome_still_reaches_the_learner():
    no_costs = GatewayEvidence(lambda url: None)
    assert asyncio.run(learned_outcomes(no_costs, [(served(0), PHRASE * 3, PHRASE * 2)])) == [served(0)]
    broken = GatewayEvidence(lambda url: object())  # a cost model that cannot price anything
    assert asyncio.run(learned_outcomes(broken, [(served(1), PHRASE * 3, PHRASE * 2)])) == [served(1)]
    assert asyncio.run(learned_outcomes(broken, [(served(2), None, None)])) == [served(2)]
    no_costs.close()
    broken.close()


def test_the_evidence_is_counted_in_the_metrics_and_the_dashboard():
    policy = load_policy("version: 1\nslices: [{name: code}]\npools: {plain: {proposer: none, workers: ['http://w:1']}}\n"
                         "rules: [{name: all, then: bypass}]\n", "p.yaml")
    telemetry = Telemetry(policy_view(policy))
    evidence = GatewayEvidence(lambda url: costs(), observe=telemetry.observe_evidence)
    asyncio.run(learned_outcomes(evidence, [(served(i), PHRASE * 3, PHRASE * 2) for i in range(2)]))
    evidence.close()
    body = telemetry.metrics_response()[0].decode()
    assert 'specgate_counterfactual_observations_total{route="default",slice="code"} 2.0' in body
    assert telemetry.dashboard_data()["evidence"] == [{"route": "default", "slice": "code", "options": 2}]
