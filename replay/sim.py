"""The discrete-event simulation of one load point: clients, the gateway's choice, the embedded workers.

Events, in time order (ties: finishes, then arrivals, then engine turns, then by creation):
- **arrival**: a client's request reaches the gateway; the chooser decides (a fixed option, or the
  policy's real ``decide()`` on a snapshot of the real learner at the simulated time) and hands it to that
  pool's worker;
- **turn**: one worker runs ``Engine.step``: intake of what arrived, admission by the worker's own
  ``Scheduler`` (running cap, KV reservation, FIFO), then ONE forward composed by the engine's own planner
  (``scheduler.plan_rounds``, ``plan_prefills``): a round of every decoding sequence, then prefill chunks of
  the others, shortest remaining prompt first (at most ``prefill_chunk`` tokens each, within what the rounds
  leave of ``max_batch_tokens``). What the simulator adds is the price instead of the forward: the cost model's
  step (:func:`replay.profile.step_s`) plus each round's seconds outside the forward. Every unit of the
  step ends when the step ends; a sequence whose prompt is prefilled decodes from the next step;
- **finish**: the answer's last token; the chooser learns (the gateway's Outcome), a closed-loop client
  sends its next request at that instant.

A turn runs whole when it starts: arrivals during it wait for the next intake, as in the engine, and its
finishes are queued at their own times, so nothing decided later in simulated time is seen earlier.
Deterministic: the same book, chooser, load, order and seed give the same result.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate
from operator import add

from backends.engine.adaptive import plan_step
from backends.engine.scheduler import Rounds, Scheduler, SeqState, plan_prefills, plan_rounds
from replay.profile import Profile, step_s

FINISH, ARRIVAL, TURN = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Load:
    """``c4``: 4 closed-loop clients; ``p0.5``: Poisson arrivals at 0.5/s; ``trace``: the recorded times."""

    label: str
    concurrency: int | None = None
    rate: float | None = None

    @classmethod
    def parse(cls, text: str) -> Load:
        if text == "trace":
            return cls(text)
        kind, value = text[:1], text[1:]
        try:
            if kind == "c" and int(value) >= 1:
                return cls(text, concurrency=int(value))
            if kind == "p" and float(value) > 0:
                return cls(text, rate=float(value))
        except ValueError:
            pass
        raise ValueError(f"--loads: {text!r} is not a load; use cN (N closed-loop clients, e.g. c4), pR (Poisson "
                         "arrivals at R requests/s, e.g. p0.5) or trace (the trace's own arrival times)")

    def arrivals(self, count: int, seed: int, start: float = 0.0) -> list[float]:
        """Times of ``count`` Poisson arrivals from ``start``: the seeded exponential gaps of one cell, drawn from
        ``f"{seed}:{label}"``, the same in replay and in the serving benchmark (bench/serve/load.py), so a replay
        reproduces a benchmark cell."""
        rng, at, out = random.Random(f"{seed}:{self.label}"), start, []
        for _ in range(count):
            out.append(at)
            at += rng.expovariate(self.rate)
        return out


@dataclass(slots=True)
class Flight:
    """One request in a simulated worker. ``reserved_tokens`` and ``status`` are what the worker's
    Scheduler reads and writes; ``state`` what the step's planner reads (scheduler.SeqState)."""

    index: int
    profile: Profile | None  # None while a walker (replay/walk.py) picks its rounds turn by turn
    reserved_tokens: int
    arrival: float
    choice: object
    target: int  # prompt tokens to prefill: all but the last, which the first round feeds
    state: SeqState  # prefilling (target - prompt_left prefilled), then decoding: a round per step
    status: object = None
    pos: int = 0  # rounds done
    ttft: float | None = None
    verify_s: float = 0.0  # the forwards of its rounds, whole steps, as the worker reports them
    area: float = 0.0  # the gateway's busy area at arrival (mean concurrency)
    walker: object = None
    drafts_s: float = 0.0  # its drafts' share of its steps' forwards (what its plain counterfactual takes away)
    plain_ratio: float | None = None  # the worker's RequestStats.plain_ratio, once finished (plain_estimates)
    neighbour_s: float = 0.0  # the worker's RequestStats.neighbour_s: what its drafts cost its steps' others


@dataclass(slots=True)
class Worker:
    name: str
    scheduler: Scheduler
    costs: object  # the pool's cost model (a profile.CachedCosts)
    inbox: list[Flight] = field(default_factory=list)
    turn_pending: bool = False
    free_at: float = 0.0  # when its last turn's work ended: a request arriving earlier waits for it
    controllers: dict = field(default_factory=dict)  # engine-wide per-round controllers (SGLang's)
    rounds: Rounds | None = None  # plan_rounds of its running flights, kept until one is admitted, decodes or leaves


@dataclass(frozen=True, slots=True)
class Served:
    """One simulated request as a client and the gateway saw it."""

    index: int
    arrival: float
    ttft: float
    e2e: float
    tokens: int
    verify_ct: int
    accepted: int
    choice: object
    concurrency: float
    plain_ratio: float | None = None  # plain decoding's estimated time over this request's (the worker's)
    neighbour_s: float = 0.0  # seconds its drafts added to the other sequences' steps (the worker's)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


def plain_ratio(flight: Flight, per_round: float) -> float | None:
    """RequestStats.plain_ratio of a finished request: its rounds cost their steps' forwards and their own seconds
    outside them; as plain steps, the forwards less the drafts' share, plus ``per_round`` (overhead, serving)."""
    p = flight.profile
    spent = flight.verify_s + sum(p.serial)
    if not flight.pos or spent <= 0:
        return None
    return p.tokens * (flight.verify_s - flight.drafts_s + flight.pos * per_round) / (flight.pos * spent)


def _drafts_share(costs, decoded: list[Flight], rounds: list[tuple[int, int]], serial: list[float],
                  forward: float, others: int) -> None:
    """The worker's plain counterfactual (Engine._verify) of one step: each round's drafts' share of the step's
    price (profile.step_s), which its plain estimate takes away; and what they cost the step's ``others``
    sequences (RequestStats.neighbour_s): each waited for that share and the round's drafting, its seconds
    outside the forward (``serial``) less the per-round ones."""
    width = len(rounds)
    per_round = costs.overhead_s + costs.serving_s
    for i, (flight, (tokens, context)) in enumerate(zip(decoded, rounds)):
        if tokens > 1:
            share = min(forward, (costs.forward_s(tokens, context, width) - costs.forward_s(1, context, width)) / width)
            flight.drafts_s += share
            if others:
                flight.neighbour_s += others * (share + max(0.0, serial[i] - per_round))


class Simulation:
    """One run: ``blocks`` of request indices (one block per slice with ``--mix by-slice``, each starting
    when the previous one has finished, as the serving benchmark's cells; one block when interleaved).
    ``chooser`` (replay/choosers.py) decides, profiles and learns; its ``prices`` hold the workers'
    cost models and their ``prefill_chunk`` and ``max_batch_tokens`` (the worker's flags)."""

    def __init__(self, chooser, load: Load, blocks: Sequence[Sequence[int]], seed: int, *,
                 max_running: int, max_total_tokens: int, arrival_of: Callable[[int], float] | None = None,
                 start: float = 0.0) -> None:
        """``start``: the clock's reading when the first block starts (a chooser whose learner served an earlier
        run keeps that run's time, so its decayed sums age on, never back)."""
        self.chooser, self.load, self.blocks, self.seed = chooser, load, blocks, seed
        prices = chooser.prices
        self.prefill_chunk, self.max_batch_tokens = prices.prefill_chunk, prices.max_batch_tokens
        self.workers = {name: Worker(name, Scheduler(max_running, max_total_tokens, 1 << 30), prices.costs_of(name))
                        for name in chooser.workers()}
        self.arrival_of = arrival_of
        self.plain_estimates = getattr(chooser, "plain_estimates", True)  # price Served.plain_ratio
        self.now = self.start = start
        self.in_flight = 0
        self._area, self._area_t = 0.0, start
        self._events: list = []
        self._n = 0
        self.served: list[Served] = []

    # -- the gateway's concurrency, as gateway/state.py integrates it --------------------------------
    def busy_area(self, now: float) -> float:
        return self._area + self.in_flight * (now - self._area_t)

    def _in_flight(self, delta: int, now: float) -> None:
        self._area, self._area_t = self.busy_area(now), now
        self.in_flight += delta

    def _push(self, t: float, kind: int, item: object) -> None:
        self._n += 1
        heapq.heappush(self._events, (t, kind, self._n, item))

    def run(self) -> list[Served]:
        start = self.start
        for block in self.blocks:
            self._feed(block, start)
            self._drain()
            start = self.now
        return self.served

    def _feed(self, block: Sequence[int], start: float) -> None:
        """Schedule the block's arrivals (open loop, trace times) or its first clients (closed loop)."""
        load = self.load
        if load.concurrency is not None:
            self._queue = deque(block)
            for _ in range(min(load.concurrency, len(block))):
                self._push(start, ARRIVAL, self._queue.popleft())
            return
        self._queue = deque()
        if load.rate is None:
            assert self.arrival_of is not None
            first = min(self.arrival_of(i) for i in block)
            for i in block:
                self._push(start + self.arrival_of(i) - first, ARRIVAL, i)
            return
        for i, at in zip(block, load.arrivals(len(block), self.seed, start)):  # the serving benchmark's draw
            self._push(at, ARRIVAL, i)

    def _drain(self) -> None:
        events = self._events
        while events:
            t, kind, _, item = heapq.heappop(events)
            self.now = t
            if kind == ARRIVAL:
                self._arrive(item, t)
            elif kind == TURN:
                self._turn(item, t)
            else:
                self._finish(item, t)

    def _arrive(self, index: int, t: float) -> None:
        choice, worker_name, plan, reserve = self.chooser.choose(index, t, self)
        worker = self.workers[worker_name]
        walker = None if isinstance(plan, Profile) else plan
        if walker is not None:
            walker.bind(worker.controllers)
        flight = Flight(index=index, profile=None if walker else plan, reserved_tokens=reserve, arrival=t,
                        choice=choice, target=plan.prompt_len - 1, area=self.busy_area(t), walker=walker,
                        state=SeqState(False, plan.prompt_len - 1, walker is not None and walker.joint))
        self._in_flight(+1, t)
        worker.scheduler.check(flight)  # a request that can never fit is refused, as the worker refuses it
        worker.inbox.append(flight)
        if not worker.turn_pending:
            worker.turn_pending = True
            self._push(max(t, worker.free_at), TURN, worker)

    def _turn(self, worker: Worker, t: float) -> None:
        """One ``Engine.step`` at ``t``, and the next ones at once while no event comes before them (the
        same result as queueing each turn, without a heap round trip per turn)."""
        scheduler, events = worker.scheduler, self._events
        running = scheduler.running
        while True:
            if worker.inbox:
                scheduler.waiting.extend(worker.inbox)
                worker.inbox.clear()
            if scheduler.waiting and scheduler.admit():
                worker.rounds = None
            if (len(running) == 1 and self._rounds(worker).decoding and running[0].walker is None
                    and not scheduler.waiting):
                # the plan of every step until the next event is this one round: its steps priced at once
                t, finished = self._alone(worker, running[0], t)
            else:
                t, finished = self._step(worker, t)
            if not (running or scheduler.waiting):
                worker.turn_pending, worker.free_at = False, t
                return
            if finished or (events and events[0][0] <= t):
                self._push(t, TURN, worker)
                return

    @staticmethod
    def _plan(running, plan: Rounds, costs) -> dict[int, int]:
        """Engine._plan_jointly's allocation of the drafts of the step's joint sequences (``plan.joint``,
        ``plan_step``), priced here: the others' widths as the step will feed them (a walker's, not chosen yet,
        as one token), the step at its mean width per sequence and the joint sequences' mean context, plus
        every round's seconds outside it."""
        joint = [running[i] for i in plan.joint]
        base, batch = len(joint), len(plan.decoding)
        for i in plan.decoding:
            flight = running[i]
            if flight.walker is None:
                base += flight.profile.fed[flight.pos]
            elif not flight.walker.joint:
                base += 1
        gains = [flight.walker.gains() for flight in joint]
        context = round(sum(flight.walker.prompt_len - 1 + flight.walker.done for flight in joint) / len(joint))
        outside = batch * (costs.overhead_s + costs.serving_s + costs.serving_extra(batch))  # batch >= 2 here

        def step_s(w: int) -> float:
            # the grid is linear in tokens between its (integer) rows, so between two integer widths too: priced
            # at integers (cached) and interpolated, as forward_s at the fractional width would give
            width, share = divmod(base + w, batch)
            low = costs.forward_s(width, context, batch)
            if share:
                low += (costs.forward_s(width + 1, context, batch) - low) * share / batch
            return low + outside

        drafts = plan_step(gains, float(batch), step_s)
        return {id(flight): k for flight, k in zip(joint, drafts)}

    @staticmethod
    def _rounds(worker: Worker) -> Rounds:
        """``plan_rounds`` of the worker's running flights: kept until one is admitted, decodes or leaves, the
        only changes of a flight's state that can change it (a prefill's progress cannot)."""
        rounds = worker.rounds
        if rounds is None:
            rounds = worker.rounds = plan_rounds([flight.state for flight in worker.scheduler.running])
        return rounds

    def _step(self, worker: Worker, t: float) -> tuple[float, bool]:
        """One step as the engine composes it (``_rounds``, ``_prefill``): a round of every decoding sequence,
        then prefill chunks, as one priced forward. Returns when it ends and whether a request finished in it."""
        scheduler, costs = worker.scheduler, worker.costs
        running = scheduler.running
        plan = worker.rounds or self._rounds(worker)
        batch = len(running)
        decoded = [running[i] for i in plan.decoding] if plan.prefilling else running[:]  # _done removes from it
        planned = self._plan(running, plan, costs) if plan.joint else None
        rounds: list[tuple[int, int]] = []
        outside: list[float] = []  # each round's seconds outside the forward
        serial, fed = 0.0, 0
        for flight in decoded:
            walker = flight.walker
            if walker is None:
                p, pos = flight.profile, flight.pos
                tokens, extra = p.fed[pos], p.serial[pos]
                rounds.append((tokens, p.context[pos]))
            else:
                tokens, context, extra = walker.next_round(batch, planned.get(id(flight)) if planned else None)
                rounds.append((tokens, context))
            serial += extra
            outside.append(extra)
            fed += tokens
        chunks = self._prefill(worker, self.max_batch_tokens - fed) if plan.prefilling else []
        forward = step_s(costs, rounds, chunks) if rounds or chunks else 0.0
        width = len(rounds)
        if width > 1:  # the serving path streams several sequences: serving_round_s(n) a round
            serial += width * costs.serving_extra(width)
        t += serial + forward
        if self.plain_estimates:
            _drafts_share(costs, decoded, rounds, outside, forward, width + len(chunks) - 1)
        finished = False
        for flight in decoded:
            pos = flight.pos = flight.pos + 1
            flight.verify_s += forward
            if pos == 1:
                flight.ttft = t - flight.arrival
            walker = flight.walker
            if walker is None:
                done = pos == len(flight.profile.fed)
            else:
                done = walker.finished
                if done:
                    flight.profile = walker.profile()
            if done:
                self._done(worker, flight, t)
                finished = True
        if plan.prefilling:  # prefilled (its last chunk in this step, or nothing to prefill): decodes next
            for flight in running:
                state = flight.state
                if not (state.decoding or state.prompt_left):
                    flight.state = SeqState(True, 0, state.joint)
                    worker.rounds = None
        for controller in worker.controllers.values():
            controller.end_step()
        return t, finished

    def _prefill(self, worker: Worker, left: int) -> list[tuple[int, int]]:
        """The step's prefill chunks ((tokens, cached context) each) within the ``left`` tokens its rounds left of
        ``max_batch_tokens``, as ``plan_prefills`` composes them; advances each one's prefill."""
        running, chunks = worker.scheduler.running, []
        for i, tokens in plan_prefills([flight.state for flight in running], left, self.prefill_chunk).chunks:
            flight = running[i]
            state = flight.state
            chunks.append((tokens, flight.target - state.prompt_left))
            flight.state = SeqState(False, state.prompt_left - tokens, state.joint)
        return chunks

    def _alone(self, worker: Worker, flight: Flight, t: float) -> tuple[float, bool]:
        """The steps of a worker running only ``flight``, decoding with a fixed profile, up to the first that
        ends at or after the next event (nothing can join before it) or the request's last round: each step
        is one round alone, so the steps' ends are a prefix sum of the profile's seconds per round, added in
        the order :meth:`_step` adds them (the same floats). Returns as _step does."""
        p, pos = flight.profile, flight.pos
        nxt = self._events[0][0] if self._events else float("inf")
        ends = accumulate(map(add, p.serial[pos:], p.alone[pos:]), initial=t)  # _step's t += serial + forward
        next(ends)  # t itself
        steps = 0
        for t in ends:  # lazily: an event may come after the first round
            steps += 1
            if steps == 1:
                first = t
            if t >= nxt:
                break
        verify_s = flight.verify_s
        for forward in p.alone[pos:pos + steps]:
            verify_s += forward
        flight.verify_s = verify_s
        if self.plain_estimates:  # _step's counterfactual for a step of one round
            forward_s, drafts_s = worker.costs.forward_s, flight.drafts_s
            for r in range(pos, pos + steps):
                if p.fed[r] > 1:
                    drafts_s += min(p.alone[r], forward_s(p.fed[r], p.context[r], 1) - forward_s(1, p.context[r], 1))
            flight.drafts_s = drafts_s
        if pos == 0:
            flight.ttft = first - flight.arrival
        flight.pos = pos + steps
        if flight.pos < len(p.fed):
            return t, False
        self._done(worker, flight, t)
        return t, True

    def _done(self, worker: Worker, flight: Flight, t: float) -> None:
        """A request's last round ended at ``t``: the worker lets it go and its answer is complete."""
        if self.plain_estimates:
            flight.plain_ratio = plain_ratio(flight, worker.costs.overhead_s + worker.costs.serving_s)
        worker.scheduler.remove(flight)
        worker.rounds = None
        self._push(t, FINISH, flight)

    def _finish(self, flight: Flight, t: float) -> None:
        e2e = t - flight.arrival
        area = self.busy_area(t) - flight.area
        self._in_flight(-1, t)
        p = flight.profile = replace(flight.profile, verify_s=flight.verify_s)
        served = Served(index=flight.index, arrival=flight.arrival, ttft=flight.ttft if flight.ttft is not None
                        else e2e, e2e=e2e, tokens=p.tokens, verify_ct=p.verify_ct, accepted=p.accepted,
                        choice=flight.choice, concurrency=area / e2e if e2e > 0 else 1.0,
                        plain_ratio=flight.plain_ratio, neighbour_s=flight.neighbour_s)
        self.served.append(served)
        self.chooser.finished(served, flight.profile, t, self)
        if self.load.concurrency is not None and self._queue:
            self._push(t, ARRIVAL, self._queue.popleft())
