"""One step's composition, engine and simulator alike (``backends/engine/scheduler.py``): on random running sets
(prompts prefilling with various lengths left, sequences decoding with various draft lengths, some of them
planned jointly) under random ``max_batch_tokens`` and ``prefill_chunk``, a real engine (tiny model; the step is
composed, not run) and a simulated worker (``replay/sim.py``) holding the same sequences read the same states,
get the same plans and compose the same step: the same rounds of the same widths in the same order, the same
sequences planned jointly over the same step, the same prefill chunks in the same order, the same prompts
decoding next. The step the engine composes also keeps the rules ``plan_prefills`` documents: rounds first and
never cut, chunks within what they leave and within ``prefill_chunk`` and the prompt left, shortest prompt left
first (running order among equals), and a prompt left short only when the budget is spent."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import backends.engine.engine as engine_module
import replay.sim as sim_module
from backends.engine.adaptive import BetaDraftLength
from backends.engine.scheduler import Scheduler, SeqState
from backends.engine.sequence import Status
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from replay.sim import Flight, Load, Simulation
from tests.engine.engine_helpers import make_tiny_engine

VOCAB = 512
CYCLE = tuple(range(20, 30))  # a decoding prompt of three cycles: n-gram drafts up to 10 tokens from it
TOKENIZER = SimpleNamespace(eos_token_id=None, decode=lambda ids, skip_special_tokens=True: "")

# a running sequence: ("prefill", prompt length, prompt positions prefilled) or ("decode", proposer, k), where
# proposer "joint" is n-gram under specgate's per-round controller (Engine._joint), the others a fixed k
PREFILLING = st.integers(1, 80).flatmap(lambda n: st.tuples(st.just("prefill"), st.just(n), st.integers(0, n - 1)))
DECODING = st.tuples(st.just("decode"), st.sampled_from(["none", "ngram", "draft_model", "joint"]), st.integers(1, 6))
SITUATIONS = st.lists(st.one_of(PREFILLING, DECODING), min_size=1, max_size=8)


def request(i: int, spec: tuple) -> GenerateRequest:
    kind, a, b = spec
    if kind == "prefill":
        return GenerateRequest(rid=f"s{i}", input_ids=tuple(100 + (7 * i + j) % 300 for j in range(a)),
                               sampling=SamplingParams(temperature=0.0, max_new_tokens=8))
    speculation = (SpeculationParams() if a == "none" else
                   SpeculationParams(proposer="ngram", draft_tokens=b, adaptive=True) if a == "joint" else
                   SpeculationParams(proposer=a, draft_tokens=b))
    return GenerateRequest(rid=f"s{i}", input_ids=CYCLE * 3, speculation=speculation,
                           sampling=SamplingParams(temperature=0.0, max_new_tokens=b + 8))


def width(spec: tuple) -> int:
    """Tokens a decoding sequence's round feeds: its last token and k drafts (every one found, all planned)."""
    return 1 if spec[1] == "none" else 1 + spec[2]


class JointWalker:
    """A per-round n-gram request's walker as the simulated step sees it: k drafts found, all taken, whether a
    joint plan allocates them or (alone in its step) its own controller; its round is told apart by its cached
    context, its position in the running list. ``planned``: the positions of those a joint plan allocated."""

    joint, finished, done = True, False, 0

    def __init__(self, k: int, index: int, planned: list) -> None:
        self.k, self.context, self.prompt_len, self.planned = k, index, index + 1, planned

    def gains(self) -> list[float]:
        return [0.9] * self.k

    def next_round(self, batch: int, planned: int | None = None) -> tuple[int, int, float]:
        if planned is not None:
            self.planned.append(self.context)
        return 1 + (self.k if planned is None else planned), self.context, 0.0


class Spy:
    """Records what a module's planner returns, calling it through."""

    def __init__(self, function) -> None:
        self.function, self.seen = function, []

    def __call__(self, *args):
        out = self.function(*args)
        self.seen.append(out)
        return out


class AllDrafts:
    """A joint plan (``adaptive.plan_step``) that takes every draft offered; records (sequences, committed)."""

    def __init__(self) -> None:
        self.seen = []

    def __call__(self, gains, committed, step_s):
        self.seen.append((len(gains), committed))
        return [len(g) for g in gains]


@pytest.fixture(scope="module")
def engine():
    return make_tiny_engine(TOKENIZER, vocab=VOCAB)


@pytest.fixture
def planners(monkeypatch):
    """Spies on the planners as the engine and the simulator call them; the joint plan takes every draft offered
    and so does a per-round controller alone in its step, so that both sides' rounds have the widths the test
    sets."""
    spies = {}
    for module in (engine_module, sim_module):
        for name in ("plan_rounds", "plan_prefills"):
            spies[module.__name__, name] = spy = Spy(getattr(module, name))
            monkeypatch.setattr(module, name, spy)
        spies[module.__name__, "plan_step"] = joint = AllDrafts()
        monkeypatch.setattr(module, "plan_step", joint)
    monkeypatch.setattr(BetaDraftLength, "gains", lambda self, context=0, cap=None: [0.9] * min(cap, self.k_max))
    monkeypatch.setattr(BetaDraftLength, "choose", lambda self, batch=1, context=0, cap=None: min(cap, self.k_max))
    return spies


def engine_step(engine, specs: list[tuple], budget: int, chunk: int):
    """The engine holding ``specs`` composes one step: (states, rounds [(position, width)], joint positions,
    chunks [(position, tokens, first prompt position)], positions decoding next)."""
    engine.config = replace(engine.config, max_batch_tokens=budget, prefill_chunk=chunk)
    engine.scheduler = Scheduler(16, 1 << 20)
    engine._slots.clear()
    for i, spec in enumerate(specs):
        engine.submit(request(i, spec), lambda out: None)
    engine._drain_inbox()
    running = engine.scheduler.admit()
    for seq, spec in zip(running, specs):
        if spec[0] == "prefill":
            seq.prefilled = seq.cache_len = spec[2]
        else:
            seq.status = Status.DECODE
            seq.prefilled = seq.cache_len = len(seq.prompt_ids) - 1
    states = engine._states()
    position = {seq.rid: i for i, seq in enumerate(running)}
    prefilled = [seq.prefilled for seq in running]
    joint = []
    real_joint = engine._plan_jointly
    engine._plan_jointly = lambda seqs, n: (joint.extend(position[s.rid] for s in seqs), real_joint(seqs, n))[1]
    try:
        works = engine._schedule()
    finally:
        del engine._plan_jointly
    rounds, chunks = [], []
    for work in works:
        i = position[work.seq.rid]
        if states[i].decoding:
            rounds.append((i, len(work.feed)))
        else:
            assert work.feed == list(work.seq.prompt_ids[prefilled[i]:prefilled[i] + len(work.feed)])
            chunks.append((i, len(work.feed), prefilled[i]))
    ends = {i: prefilled[i] + tokens for i, tokens, _ in chunks}
    decoding_next = [i for i, seq in enumerate(running) if not states[i].decoding
                     and (seq.status is Status.DECODE or ends.get(i) == len(seq.prompt_ids) - 1)]
    return states, rounds, joint, chunks, decoding_next


def simulated_step(specs: list[tuple], budget: int, chunk: int, monkeypatch):
    """A simulated worker holding the same sequences steps once: what ``engine_step`` returns, from the flights."""
    costs = SimpleNamespace(overhead_s=0.0, serving_s=0.0, serving_extra=lambda n: 0.0, forward_s=lambda *a: 0.01)
    chooser = SimpleNamespace(prices=SimpleNamespace(prefill_chunk=chunk, max_batch_tokens=budget,
                                                     costs_of=lambda name: costs),
                              workers=lambda: ["w"], plain_estimates=False)
    sim = Simulation(chooser, Load.parse("c1"), [[0]], 0, max_running=16, max_total_tokens=1 << 20)
    worker, joint, flights = sim.workers["w"], [], []
    for i, spec in enumerate(specs):
        kind, a, b = spec
        if kind == "prefill":
            state, profile, walker, target = SeqState(False, a - 1 - b), None, None, a - 1
        elif a == "joint":
            state, profile, walker, target = SeqState(True, 0, True), None, JointWalker(b, i, joint), len(CYCLE) * 3 - 1
        else:  # a fixed profile of two rounds of this width, its context its position
            state, walker, target = SeqState(True), None, len(CYCLE) * 3 - 1
            profile = SimpleNamespace(fed=(width(spec),) * 2, context=(i, i), serial=(0.0, 0.0))
        flights.append(Flight(index=i, profile=profile, reserved_tokens=1, arrival=0.0, choice=None, target=target,
                              state=state, walker=walker))
    worker.scheduler.running = list(flights)
    states = [flight.state for flight in flights]
    priced = []
    monkeypatch.setattr(sim_module, "step_s", lambda costs, rounds, chunks: priced.append((rounds, chunks)) or 0.0)
    sim._step(worker, 0.0)
    assert len(priced) <= 1
    rounds, chunk_shapes = priced[0] if priced else ([], [])  # nothing to price: one-token prompts only
    advanced = {i: states[i].prompt_left - flight.state.prompt_left for i, flight in enumerate(flights)
                if not states[i].decoding and states[i].prompt_left != flight.state.prompt_left}
    planned = sim_module.plan_prefills.seen[-1].chunks if sim_module.plan_prefills.seen else ()
    chunks = [(i, tokens, flights[i].target - states[i].prompt_left) for i, tokens in planned]
    assert [(tokens, start) for _, tokens, start in chunks] == chunk_shapes  # the plan, as priced
    assert {i: tokens for i, tokens, _ in chunks} == advanced  # and as applied
    decoding_next = [i for i, flight in enumerate(flights) if not states[i].decoding and flight.state.decoding]
    return states, [(context, tokens) for tokens, context in rounds], joint, chunks, decoding_next


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=SITUATIONS, budget=st.integers(1, 160), chunk=st.integers(1, 64))
def test_the_simulator_composes_the_step_the_engine_composes(engine, planners, monkeypatch, specs, budget, chunk):
    for spy in planners.values():
        spy.seen.clear()
    states, rounds, joint, chunks, decoding_next = engine_step(engine, specs, budget, chunk)
    simulated = simulated_step(specs, budget, chunk, monkeypatch)
    assert simulated == (states, rounds, joint, chunks, decoding_next)
    for name in ("plan_rounds", "plan_prefills", "plan_step"):  # the plans each got, one per step
        assert planners["backends.engine.engine", name].seen == planners["replay.sim", name].seen, name

    # the rules, on the step the engine composed
    decoding = [i for i, spec in enumerate(specs) if spec[0] == "decode"]
    assert [i for i, _ in rounds] == decoding  # every decoding sequence rounds, once, in running order
    assert [w for _, w in rounds] == [width(specs[i]) for i in decoding]
    eligible = [i for i in decoding if specs[i][1] == "joint"]
    assert joint == (eligible if len(eligible) > 1 else [])  # planned together only two or more
    assert planners["replay.sim", "plan_step"].seen == ([(len(eligible), float(len(decoding)))] if joint else [])
    fed = sum(w for _, w in rounds)
    prefilled = sum(tokens for _, tokens, _ in chunks)
    assert prefilled <= max(0, budget - fed)  # rounds first, never cut; chunks within what they leave
    need = {i: states[i].prompt_left for i, spec in enumerate(specs) if spec[0] == "prefill"}
    for i, tokens, _ in chunks:
        assert 1 <= tokens <= min(chunk, need[i])
    keys = [(need[i], i) for i, _, _ in chunks]
    assert keys == sorted(keys)  # shortest prompt left first, running order among equals
    got = {i: tokens for i, tokens, _ in chunks}
    if any(got.get(i, 0) < min(chunk, n) for i, n in need.items() if n):
        assert fed + prefilled >= budget  # a prompt is left short only when the budget is spent
    assert decoding_next == sorted(i for i, n in need.items() if got.get(i, 0) == n)
