"""What the simulated worker reports beside each request's times, as the embedded worker does: its plain
counterfactual (``Served.plain_ratio``, what auto learns plain decoding's TPOT from) and what its drafts cost
the sequences beside it (``Served.neighbour_s``, what auto charges); and the simulator's fast paths
(``Simulation._alone``, a worker's step plan kept across steps), bit-identical to stepping every round through
``_step`` planned afresh. Prices from test_replay_sim.py's hand-made cost model."""

from __future__ import annotations

import msgspec
import pytest

import replay.sim as sim_module
from replay.book import PLAIN, Option, RoundBook
from replay.choosers import FixedChooser, Prices
from replay.sim import Load, Simulation
from policies.trace import Trace
from tests.replay.sim_helpers import COSTS, HEADER, OVERHEAD, copy_friendly, forward, prices_of, request, simulate


def test_each_request_reports_the_workers_plain_counterfactual():
    """``Served.plain_ratio``, as the worker computes it (Engine._verify): per round, the step's forward less
    the round's drafts' share (alone: the forward of one token), plus the overhead; over the rounds' own
    seconds, scaled by tokens per round. A plain request's is 1. Priced only for a chooser that learns from it
    (a policy); a fixed arm's requests carry none."""
    cycle = list(range(1, 11))
    prices = prices_of(request(0, 0, rid="copy", prompt=cycle * 5, output=cycle * 2))  # n-gram drafts the cycle
    for option in (Option("ngram", 4), PLAIN):
        assert simulate(prices, "c1", [[0]], option=option)[0].plain_ratio is None
        chooser = FixedChooser(option, prices, 0)
        chooser.plain_estimates = True
        seen = {}
        chooser.finished = lambda served, prof, t, sim: seen.update(served=served, prof=prof)
        Simulation(chooser, Load.parse("c1"), [[0]], 0, max_running=16, max_total_tokens=1 << 16).run()
        served, prof = seen["served"], seen["prof"]
        if option is PLAIN:
            assert served.plain_ratio == pytest.approx(1.0, rel=1e-12)
            continue
        assert prof.accepted > 0 and served.verify_ct < served.tokens == 20
        spent = sum(forward(f, c) + s for f, c, s in zip(prof.fed, prof.context, prof.serial))
        plain = sum(forward(1, c) + OVERHEAD for c in prof.context)
        assert served.plain_ratio == pytest.approx(20 * plain / (len(prof.fed) * spent), rel=1e-9)


def test_each_request_reports_what_its_drafts_cost_the_sequences_beside_it():
    """``Served.neighbour_s``, as the worker computes it (Engine._verify): per round with drafts, the step's
    other sequences x (the drafts' share of the step's forward + the round's drafting). Two identical requests
    at c2 decode side by side, every round in one step with the other: one other each. Alone (c1) nothing;
    plain decoding nothing."""
    cycle = list(range(1, 11))
    copy = [request(0, 0, rid=f"copy{i}", prompt=cycle * 5, output=cycle * 2) for i in range(2)]
    prices = prices_of(*copy)
    costs = prices.costs_of(FixedChooser(PLAIN, prices, 0).worker)
    per_round = costs.overhead_s + costs.serving_s
    for option, load in ((Option("ngram", 4), "c2"), (Option("ngram", 4), "c1"), (PLAIN, "c2")):
        chooser = FixedChooser(option, prices, 0)
        chooser.plain_estimates = True
        seen = []
        chooser.finished = lambda served, prof, t, sim: seen.append((served, prof))
        Simulation(chooser, Load.parse(load), [[0, 1]], 0, max_running=16, max_total_tokens=1 << 16).run()
        assert len(seen) == 2
        for served, prof in seen:
            if option is PLAIN or load == "c1":
                assert served.neighbour_s == 0.0
                continue
            assert prof.accepted > 0 and served.ttft == seen[0][0].ttft  # prefilled and decoded together
            want = sum((costs.forward_s(f, c, 2) - costs.forward_s(1, c, 2)) / 2 + (s - per_round)
                       for f, c, s in zip(prof.fed, prof.context, prof.serial) if f > 1)
            assert served.neighbour_s == pytest.approx(want, rel=1e-9) and want > 0


def plain_and_ngram_served(prices: Prices, load: str, n: int) -> dict:
    """The first ``n`` requests served plain and with ngram-k4 at ``load`` (the plain counterfactual priced)."""
    out = {}
    for option in (PLAIN, Option("ngram", 4)):
        chooser = FixedChooser(option, prices, 0)
        chooser.plain_estimates = True
        sim = Simulation(chooser, Load.parse(load), [list(range(n))], 0, max_running=16, max_total_tokens=1 << 16)
        out[option] = sorted(sim.run(), key=lambda s: s.index)
    return out


@pytest.mark.parametrize("load", ["c1", "p20", "p200", "c3"])
def test_a_worker_running_one_sequence_jumps_to_the_next_event_with_the_same_floats(load, monkeypatch):
    """Simulation._alone (a worker holding one decoding request with a fixed profile runs its rounds as a
    prefix sum up to the next event) gives bit-identical results to stepping each round through _step,
    including the plain counterfactual, at c1 (nothing else ever arrives), under Poisson arrivals that land
    mid-request and alongside batched steps."""
    prices = prices_of(*copy_friendly(10))

    def run():
        return plain_and_ngram_served(prices, load, 10)

    calls = []
    real_alone = Simulation._alone
    monkeypatch.setattr(Simulation, "_alone", lambda self, *a: calls.append(1) or real_alone(self, *a))
    fast = run()
    assert calls  # the fast path ran
    monkeypatch.setattr(Simulation, "_alone", lambda self, worker, flight, t: self._step(worker, t))
    assert run() == fast
    assert all(s.plain_ratio is not None for served in fast.values() for s in served)


@pytest.mark.parametrize("load", ["c3", "c16", "p20", "p200"])
def test_a_step_plan_kept_across_steps_gives_the_same_floats_as_planning_every_step(load, monkeypatch):
    """Simulation._rounds keeps a worker's ``plan_rounds`` until a request is admitted, decodes or leaves;
    planning every step afresh is bit-identical: the same steps, prefill chunks, plain counterfactual and
    finishes, at closed and Poisson loads where prompts prefill beside other requests' rounds (serving cost per
    stream count included)."""
    costs = msgspec.structs.replace(COSTS, serving_s=0.004, serving_streams=[2, 8], serving_streams_s=[0.006, 0.001])
    prices = Prices(RoundBook(Trace(HEADER, list(copy_friendly(12)))), costs)

    def run():
        return plain_and_ngram_served(prices, load, 12)

    plans = []
    real_plan = sim_module.plan_rounds
    monkeypatch.setattr(sim_module, "plan_rounds", lambda states: plans.append(1) or real_plan(states))
    fast = run()
    kept = len(plans)
    monkeypatch.setattr(Simulation, "_rounds", staticmethod(
        lambda worker: sim_module.plan_rounds([f.state for f in worker.scheduler.running])))
    assert run() == fast
    assert 0 < kept < len(plans) - kept  # the plan was kept across steps
    assert all(s.plain_ratio is not None for served in fast.values() for s in served)
    # neighbour_s too (Served compares whole): n-gram's rounds beside others charge them, plain's never
    assert any(s.neighbour_s > 0 for s in fast[Option("ngram", 4)]) and not any(s.neighbour_s for s in fast[PLAIN])
