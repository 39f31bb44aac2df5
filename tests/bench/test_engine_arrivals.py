"""bench.engine_arrivals: its Poisson offsets are the ones bench serve and replay draw, and it serves every request
on a tiny random engine, in order, Poisson ones not before their arrival, closed-loop ones at most c in flight."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

from bench.engine_arrivals import arrivals, serve
from backends.engine.types import SpeculationParams
from replay.sim import Load


def test_poisson_offsets_are_the_serving_benchmarks_and_a_closed_loop_has_none():
    rng = random.Random("7:p2")
    expected, at = [], 0.0
    for _ in range(5):
        expected.append(at)
        at += rng.expovariate(2.0)
    assert arrivals(Load.parse("p2"), 5, 7) == expected
    assert arrivals(Load.parse("c4"), 5, 7) is None


def requests(n: int):
    return [SimpleNamespace(prompt_ids=[100 + i, 200 + i, 300 + i], sampling=SimpleNamespace(max_new_tokens=5))
            for i in range(n)]


def test_a_closed_loop_serves_every_request_with_at_most_c_in_flight(tiny_engine):
    in_flight, submitted = [], []
    real = tiny_engine.submit

    def spy(request, on_output):
        submitted.append(request.input_ids)
        in_flight.append(len(tiny_engine.scheduler.running) + len(tiny_engine.scheduler.waiting)
                         + tiny_engine._inbox.qsize())
        real(request, on_output)

    tiny_engine.submit = spy
    tpot = serve(tiny_engine, requests(5), Load.parse("c2"), 0, SpeculationParams(proposer="ngram", draft_tokens=2))
    assert submitted == [tuple(r.prompt_ids) for r in requests(5)]
    assert max(in_flight) <= 1  # at most one other in flight when a request is submitted
    assert len(tpot) == 5 and all(t is not None and t > 0 for t in tpot)


def test_poisson_requests_are_submitted_in_order_and_not_before_their_arrival(tiny_engine):
    load, start, times = Load.parse("p20"), time.perf_counter(), []
    real = tiny_engine.submit

    def spy(request, on_output):
        times.append(time.perf_counter() - start)
        real(request, on_output)

    tiny_engine.submit = spy
    tpot = serve(tiny_engine, requests(4), load, 3, SpeculationParams())
    assert len(tpot) == 4 and all(t is not None and t > 0 for t in tpot)
    assert all(t >= due for t, due in zip(times, arrivals(load, 4, 3)))
