"""A request whose draft length the engine picks every round (``adaptive`` with a strategy of
backends/engine/adaptive.py), walked one unit per simulated engine turn.

A fixed option's rounds are a function of the request alone (replay/book.py), so its profile is
computed once. A per-round controller's k depends on what it observed so far and, for the SGLang and vLLM
controllers, on the engine's batch at that turn (SGLang's EMA is shared by the sequences of one engine and
moves once per engine step; vLLM's table reads the batch size). So the walker asks the real controller for
k at each of its turns, with the batch the simulated engine runs, and replays the round exactly: a round
starting at output position p with budget b drafts min(b, lens[p]) tokens and accepts min(that, runs[p])
(:meth:`RoundBook.positions`). Its shape and seconds outside the forward are a fixed round's
(:func:`profile.round_parts`; the simulator prices the step it joins); the controller's own cost model is
the engine's view (forward by width at the request's prompt length, draft and overhead:
``StepCosts.round_s``). The recorded rounds give the request's Profile when it finishes.
"""

from __future__ import annotations

import random
from dataclasses import replace

from backends.engine.adaptive import best_k, controller_for, match_context
from backends.engine.types import SpeculationParams
from replay.book import NGRAM_SPAN, Option
from replay.profile import Profile, profile, round_parts


# replay only (:class:`Clairvoyant`): a controller that knows each round's accepted run (oracle), or the trace's
# own acceptance rates by n-gram match context and position (informed)
ORACLE, INFORMED = "oracle", "informed"
KNOWING = (ORACLE, INFORMED)


class Walker:
    """One request under a per-round ``option`` (``option.strategy`` set). ``lens``/``runs``: per output
    position, as RoundBook.positions gives them; ``seed``: the controller's sampling seed."""

    def __init__(self, costs, prompt_len: int, output_len: int, max_new: int, option: Option,
                 lens: list[int], runs: list[int], matches: list[int], seed: int,
                 rates: dict[tuple, list[float]] | None = None, keys: list[tuple] | None = None) -> None:
        """``rates``: the trace's rates by feature key (RoundBook.context_rates), for ``informed``; ``keys``: this
        request's key at each output position (RoundBook.feature_keys)."""
        self.costs, self.option = costs, option
        self.prompt_len, self.output_len, self.max_new = prompt_len, output_len, max_new
        self.lens, self.runs, self.matches = lens, runs, matches
        self.seed, self.rates, self.keys = seed, rates, keys
        self.prefix = option.proposer == "ngram"  # drafts first, the controller picks k knowing them (engine)
        self.serial: list[float] = []
        self.draft_total = self.verify_total = 0.0
        self.controller = None
        self.done = 0
        self.batch = 1  # the sequences of the step being planned
        self._table: tuple[float, ...] | None = None  # the controller's cost by k in a step of `batch`
        self.drafted: list[int] = []
        self.accepted: list[int] = []
        self.budgets: list[int] = []
        self.setup = costs.setup_s(option.proposer, prompt_len)

    def bind(self, shared: dict) -> None:
        """Make the controller; ``shared``: the simulated worker's engine-wide controllers."""
        if self.option.strategy in KNOWING:
            self.controller = Clairvoyant(self, self.rates if self.option.strategy == INFORMED else None)
            return
        spec = SpeculationParams(proposer=self.option.proposer, draft_tokens=self.option.k, adaptive=True,
                                 strategy=self.option.strategy, k_by_batch=self.option.table)
        self.controller = controller_for(spec, self._round_costs, self.seed, shared)

    def _round_costs(self, k_max: int) -> tuple[float, ...]:
        """The engine's StepCosts.round_s by k: seconds of the step of ``batch`` rounds a round of k drafts joins."""
        return self._table

    @property
    def joint(self) -> bool:
        """Whether the engine plans this request's drafts jointly with the step's others (Engine._joint)."""
        return self.prefix and self.option.strategy in ("beta", *KNOWING)

    def gains(self) -> list[float]:
        """The controller's drawn marginal tokens for this round's drafts found (Engine._plan_jointly; n-gram)."""
        done = self.done
        k_cap = max(0, min(self.option.k, self.max_new - done - 1))
        return self.controller.gains(match_context(self.matches[done]), min(k_cap, self.lens[done]))

    @property
    def finished(self) -> bool:
        return self.done >= self.output_len

    def next_round(self, batch: int, planned: int | None = None) -> tuple[int, int, float]:
        """This request's next round in an engine step running ``batch`` sequences: (tokens fed, cached
        context, seconds outside the forward). ``planned``: its drafts from the step's joint plan (then the
        controller is not asked)."""
        done, controller = self.done, self.controller
        self._price(batch)
        k_cap = max(0, min(self.option.k, self.max_new - done - 1))
        context = match_context(self.matches[done])
        if planned is not None:  # a joint plan's drafts (n-gram: k_cap proposed, then cut)
            budget, called = planned, k_cap
        elif self.prefix:  # Engine._round: propose k_cap, then k <= the drafts found, knowing their match
            budget = controller.choose(batch, context, cap=min(k_cap, self.lens[done]))
            called = k_cap
        else:
            budget = called = max(0, min(controller.choose(batch), k_cap))
        drafted = min(budget, self.lens[done])
        accepted = min(drafted, self.runs[done])
        controller.observe(drafted, accepted, context)
        return self._commit(drafted, accepted, budget, called)

    def _price(self, batch: int) -> None:
        """The controller's cost table for a round in a step of ``batch`` sequences (kept while it is the same)."""
        if batch != self.batch or self._table is None:
            self.batch = batch
            self._table = self.costs.round_costs(self.option.proposer, self.option.k, self.prompt_len, batch)

    def _commit(self, drafted: int, accepted: int, budget: int, called: int) -> tuple[int, int, float]:
        """Record a round (``called``: the k the proposer was called with) and move past what it commits;
        :meth:`next_round`'s answer."""
        done = self.done
        cached = self.prompt_len - 1 + done
        draft, verify = round_parts(self.costs, self.option.proposer, drafted, called, cached)
        if called > 0:
            draft, self.setup = draft + self.setup, 0.0
        self.drafted.append(drafted)
        self.accepted.append(accepted)
        self.budgets.append(budget)
        self.draft_total += draft
        self.verify_total += verify
        self.done = min(self.output_len, done + accepted + 1)
        self.serial.append(draft + self.costs.overhead_s + self.costs.serving_s)
        return drafted + 1, cached, self.serial[-1]

    def profile(self) -> Profile:
        """The finished request's Profile: the worker's statistics of its rounds, the seconds it was walked
        with (an n-gram round calls the proposer whatever k the controller then picks)."""
        rounds = (tuple(self.drafted), tuple(self.accepted), tuple(self.budgets))
        stats = profile(self.costs, self.prompt_len, self.output_len, self.option, rounds)
        return replace(stats, serial=tuple(self.serial), draft_s=self.draft_total, verify_s=self.verify_total)


class Clairvoyant:
    """Per-round controllers no engine can run, replay's references for what choosing k per round could reach:
    - ``oracle`` (``rates`` None) knows how many drafts each round will accept (the trace's committed output):
      its gains are 1 for every draft that will be accepted and 0 after: perfect prediction;
    - ``informed`` knows the trace's own acceptance rate of every draft position in every n-gram match context
      (RoundBook.context_rates: in-sample, no learning, no sampling): its gains are their running products, the
      best any controller predicting from the match context alone can know; keyed by other features
      (``informed=request+match``, book.FEATURES), the best a predictor from those features can know.
    A round alone drafts the k with the best committed tokens per second of the step it joins (``best_k`` on
    those gains); in a step with other per-round sequences the simulator plans them together (``plan_step``),
    so each step gets the best allocation of drafts for that step. References, not upper bounds: they are
    optimal step by step, not over the request's rounds (a round's k also moves where the next round starts)."""

    __slots__ = ("walker", "rates")

    def __init__(self, walker: Walker, rates: dict[int, list[float]] | None = None) -> None:
        self.walker, self.rates = walker, rates

    def _known(self, cap: int) -> list[float]:
        w = self.walker
        if self.rates is None:
            run = min(cap, w.runs[w.done])
            return [1.0] * run + [0.0] * (cap - run)
        gains, survive = [], 1.0
        for rate in self.rates.get(w.keys[w.done], ())[:cap]:
            survive *= rate
            gains.append(survive)
        return gains + [0.0] * (cap - len(gains))

    def gains(self, context: int = 0, cap: int | None = None) -> list[float]:
        return self._known(self.walker.option.k if cap is None else cap)

    def choose(self, batch: int = 1, context: int = 0, cap: int | None = None) -> int:
        k_max = self.walker.option.k if cap is None else min(cap, self.walker.option.k)
        if k_max <= 0:
            return 0
        return best_k(self._known(k_max), k_max, self.walker._table, batch - 1)

    def observe(self, proposed: int, accepted: int, context: int = 0) -> None:
        pass

    def end_step(self) -> None:
        pass


def drawn_positions(rates: list[float], output_len: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """Per-position runs for a sampled request (no exact counterfactual): from each position, draft j
    accepted with its slice's measured conditional rate (RoundBook.position_rates), drawn from ``rng``;
    labelled estimated like RoundBook.estimated_rounds."""
    runs = []
    for p in range(output_len):
        run = 0
        while run < len(rates) and p + run < output_len and rng.random() < rates[run]:
            run += 1
        runs.append(run)
    return [NGRAM_SPAN] * output_len, runs
