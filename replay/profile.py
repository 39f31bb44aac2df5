"""A request's rounds on the embedded engine under one option, and the price of an engine step.

The engine (backends/engine/engine.py) batches continuously: every step runs ONE target forward holding a
round of every decoding sequence (the last committed token and its k drafts) and then prefill chunks of
admitted prompts, shortest remaining first, each at most ``prefill_chunk`` tokens, within what the rounds leave of
``max_batch_tokens`` (the last prompt token is left for the first round). So a round's seconds depend on
the step it shares, and the simulator (replay/sim.py) prices steps: a :class:`Profile` holds each
round's shape (tokens fed, cached context) and its seconds outside the forward (the proposer's call, the
per-round overhead, the serving path's cost per streamed round), computed once per (request, option) and
reused at every load and seed; :func:`step_s` prices the forward of a step from the cost model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from replay.book import Option, Rounds


class CachedCosts:
    """A cost model's lookups memoized by argument: a sweep prices the same (width, context) pairs for every
    option of a request, and a lookup interpolates in Python (~3 us) where a dict hit costs ~0.1 us. At most
    (widths x contexts x batch sizes) entries."""

    __slots__ = ("costs", "overhead_s", "serving_s", "_extra", "_forward", "_draft", "_prefill", "_rounds")

    def __init__(self, costs) -> None:
        self.costs, self.overhead_s, self.serving_s = costs, costs.overhead_s, costs.serving_s
        self._extra: list[float] = []
        self._forward: dict[tuple[int, int, int], float] = {}
        self._draft: dict[tuple[str, int, int], float] = {}
        self._prefill: dict[tuple[int, int], float] = {}
        self._rounds: dict[tuple[str, int, int, int], tuple[float, ...]] = {}

    def serving_extra(self, streams: int) -> float:
        """What each round of a step streaming ``streams`` sequences costs on top of ``serving_s`` (which every
        profile's rounds already hold): CostModel.serving_round_s less serving_s."""
        extra = self._extra
        while len(extra) <= streams:
            extra.append(self.costs.serving_round_s(len(extra)) - self.serving_s)
        return extra[streams]

    def forward_s(self, tokens: int, context: int, batch: int = 1) -> float:
        key = (tokens, context, batch)
        hit = self._forward.get(key)
        if hit is None:
            hit = self._forward[key] = self.costs.forward_s(tokens, context, batch)
        return hit

    def draft_s(self, proposer: str, k: int, context: int) -> float:
        key = (proposer, k, context)
        hit = self._draft.get(key)
        if hit is None:
            hit = self._draft[key] = self.costs.draft_s(proposer, k, context)
        return hit

    def prefill_s(self, tokens: int, context: int) -> float:
        key = (tokens, context)
        hit = self._prefill.get(key)
        if hit is None:
            hit = self._prefill[key] = self.costs.prefill_s(tokens, context)
        return hit

    def round_costs(self, proposer: str, k_max: int, context: int, batch: int) -> tuple[float, ...]:
        """Seconds of a round of k = 0..k_max drafts as the engine's per-round controller prices it
        (StepCosts.round_s): the forward of the step of ``batch`` rounds it joins (the others feeding one token
        each), its drafts, the per-round overhead; at the request's prompt length ``context``."""
        key = (proposer, k_max, context, batch)
        hit = self._rounds.get(key)
        if hit is None:
            hit = self._rounds[key] = tuple(
                self.forward_s(k + 1 if batch == 1 else 1 + k / batch, context, batch)
                + (self.draft_s(proposer, k, context) if k else 0.0) + self.overhead_s for k in range(k_max + 1))
        return hit

    def setup_s(self, proposer: str, prompt_tokens: int) -> float:
        return self.costs.setup_s(proposer, prompt_tokens)


def step_s(costs, rounds: Sequence[tuple[int, int]], chunks: Sequence[tuple[int, int]]) -> float:
    """Seconds of one engine forward holding ``rounds`` ((tokens fed, cached context) per decoding sequence)
    and prefill ``chunks`` ((tokens, cached context) each).

    Rounds: the mean over the step's B sequences of a B-sequence forward at each one's own shape
    (``CostModel.forward_s(tokens, context, B)``; a ragged step's linear layers run once over all its rows,
    its attention per sequence). With a cost model measured at batch 1 only, a B-sequence forward costs B
    single ones (``forward_s`` above its largest batch), so a step costs the sum of its rounds alone: the
    engine as it was before continuous batching. Chunks: each its ``prefill_s``, added (a chunk's rows are
    compute-bound, hundreds of milliseconds here, and share only the weight read, ~25 ms, with the rounds:
    an upper bound by that much when both are in one step)."""
    seconds = 0.0
    batch = len(rounds)
    if batch == 1:
        seconds = costs.forward_s(rounds[0][0], rounds[0][1], 1)
    elif batch:
        forward = costs.forward_s
        for tokens, context in rounds:
            seconds += forward(tokens, context, batch)
        seconds /= batch
    for tokens, context in chunks:
        seconds += costs.prefill_s(tokens, context)
    return seconds


@dataclass(frozen=True, slots=True)
class Profile:
    """One request's rounds under one option: per round the tokens it feeds the target (``fed``: the last
    committed token and its drafts), the positions cached before that forward (``context``) and its
    seconds outside the forward (``serial``: the proposer's call, with the proposer's once-per-request
    setup on the first one that drafts, the per-round overhead and ``serving_s``). The rest is what the
    worker reports for the request (RequestStats: per-position counts include the positions a round's
    budget asked for); ``verify_s`` prices each forward alone (the simulator replaces it with the steps' own
    seconds, as the worker reports them)."""

    prompt_len: int
    fed: tuple[int, ...]
    context: tuple[int, ...]
    serial: tuple[float, ...]
    alone: tuple[float, ...]  # each round's forward in a step of its own (batch 1)
    tokens: int
    verify_ct: int
    accepted: int  # drafts accepted, all rounds
    histogram: tuple[int, ...]
    accepted_per_position: tuple[int, ...]
    reached_per_position: tuple[int, ...]
    draft_s: float
    verify_s: float


def round_parts(costs, proposer: str, drafted: int, budget: int, context: int) -> tuple[float, float]:
    """(draft seconds, verify seconds alone) of one round at ``context`` cached positions: the proposer is
    called when the round's budget is >= 1 (it may draft fewer), the target scores the last token and the
    drafts."""
    draft = costs.draft_s(proposer, max(drafted, 1), context) if budget > 0 else 0.0
    return draft, costs.forward_s(drafted + 1, context)


def profile(costs, prompt_len: int, output_len: int, option: Option, rounds: Rounds) -> Profile:
    """The rounds of one request (``costs``: a policies.costmodel.CostModel or its :class:`CachedCosts`).
    The proposer's once-per-request setup (``setup_s``: indexing the prompt) is paid by its first draft."""
    drafted_t, accepted_t, budgets = rounds
    width = max((max(d, b) for d, b in zip(drafted_t, budgets)), default=0)
    hist = [0] * (max(accepted_t, default=0) + 1)
    acc_pp, reach_pp = [0] * width, [0] * width
    fed, contexts, serial, alone = [], [], [], []
    draft_total = verify_total = 0.0
    committed = 0
    per_round = costs.overhead_s + costs.serving_s
    setup = costs.setup_s(option.proposer, prompt_len) if option.proposer != "none" else 0.0
    for drafted, accepted, budget in zip(drafted_t, accepted_t, budgets):
        context = prompt_len - 1 + committed  # cached positions when the round's forward runs
        draft, verify = round_parts(costs, option.proposer, drafted, budget, context)
        if budget > 0:
            draft, setup = draft + setup, 0.0
        fed.append(drafted + 1)
        contexts.append(context)
        serial.append(draft + per_round)
        alone.append(verify)
        draft_total += draft
        verify_total += verify
        hist[accepted] += 1
        for j in range(max(drafted, budget)):
            if j <= accepted:
                reach_pp[j] += 1
            if j < accepted:
                acc_pp[j] += 1
        committed = min(output_len, committed + accepted + 1)
    return Profile(prompt_len=prompt_len, fed=tuple(fed), context=tuple(contexts), serial=tuple(serial), alone=tuple(alone),
                   tokens=output_len, verify_ct=len(accepted_t), accepted=sum(accepted_t), histogram=tuple(hist),
                   accepted_per_position=tuple(acc_pp), reached_per_position=tuple(reach_pp),
                   draft_s=draft_total, verify_s=verify_total)
