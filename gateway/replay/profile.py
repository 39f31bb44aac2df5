"""A request's timeline on the embedded engine under one option: the durations of its scheduling units
and the per-request statistics the worker reports, from its rounds and the cost model.

The engine (backends/engine/engine.py) gives every running sequence one unit per turn: a prefill chunk
(``prefill_chunk`` prompt tokens, the last prompt token excepted: the first round feeds it) or one round.
A round drafts (the proposer's time), feeds ``[last token, d_1..d_k]`` to the target in one forward at
the sequence's cached length, and pays a fixed overhead (sampling, verification, commit) and the serving
path's cost per streamed round (``CostModel.serving_s``). So a unit's
seconds do not depend on the other sequences (one sequence per forward), and a request's units are
computed once per option and reused at every load and seed. An engine that batches sequences into one
forward (issue 27) breaks this: its step cost depends on the batch, and this module must then price
steps, not units.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.replay.book import Option, Rounds


class CachedCosts:
    """A cost model's lookups memoized by argument: a sweep prices the same (width, context) pairs for every
    option of a request, and a lookup interpolates in Python (~3 us) where a dict hit costs ~0.1 us. At most
    (widths x contexts) entries: ~140k for a 8192-token window."""

    __slots__ = ("costs", "overhead_s", "serving_s", "_forward", "_draft", "_prefill")

    def __init__(self, costs) -> None:
        self.costs, self.overhead_s, self.serving_s = costs, costs.overhead_s, costs.serving_s
        self._forward: dict[tuple[int, int], float] = {}
        self._draft: dict[tuple[str, int, int], float] = {}
        self._prefill: dict[tuple[int, int], float] = {}

    def forward_s(self, tokens: int, context: int) -> float:
        key = (tokens, context)
        hit = self._forward.get(key)
        if hit is None:
            hit = self._forward[key] = self.costs.forward_s(tokens, context)
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

    def setup_s(self, proposer: str, prompt_tokens: int) -> float:
        return self.costs.setup_s(proposer, prompt_tokens)


@dataclass(frozen=True, slots=True)
class Profile:
    """``units``: seconds of each unit in order (prefill chunks, then rounds); ``first``: the index of the
    first round (its end is the first token). The rest is what the worker reports for the request
    (RequestStats: per-position counts include the positions a round's budget asked for)."""

    units: tuple[float, ...]
    first: int
    tokens: int
    verify_ct: int
    accepted: int  # drafts accepted, all rounds
    histogram: tuple[int, ...]
    accepted_per_position: tuple[int, ...]
    reached_per_position: tuple[int, ...]
    draft_s: float
    verify_s: float


def round_parts(costs, proposer: str, drafted: int, budget: int, context: int) -> tuple[float, float]:
    """(draft seconds, verify seconds) of one round at ``context`` cached positions: the proposer is called
    when the round's budget is >= 1 (it may draft fewer), the target scores the last token and the drafts."""
    draft = costs.draft_s(proposer, max(drafted, 1), context) if budget > 0 else 0.0
    return draft, costs.forward_s(drafted + 1, context)


def prefill_units(costs, prompt_len: int, prefill_chunk: int) -> list[float]:
    """The engine's _prefill: one chunk per turn, at least one turn (even for a 1-token prompt)."""
    units: list[float] = []
    target, done = prompt_len - 1, 0
    while True:
        end = min(target, done + prefill_chunk)
        units.append(costs.prefill_s(end - done, done) if end > done else 0.0)
        done = end
        if done == target:
            return units


def profile(costs, prompt_len: int, output_len: int, option: Option, rounds: Rounds,
            prefill_chunk: int) -> Profile:
    """The timeline of one request (``costs``: a policies.costmodel.CostModel or its :class:`CachedCosts`).
    The proposer's once-per-request setup (``setup_s``: indexing the prompt) is paid by its first draft."""
    units = prefill_units(costs, prompt_len, prefill_chunk)
    first = len(units)
    drafted_t, accepted_t, budgets = rounds
    width = max((max(d, b) for d, b in zip(drafted_t, budgets)), default=0)
    hist = [0] * (max(accepted_t, default=0) + 1)
    acc_pp, reach_pp = [0] * width, [0] * width
    draft_total = verify_total = 0.0
    committed = 0
    setup = costs.setup_s(option.proposer, prompt_len) if option.proposer != "none" else 0.0
    for drafted, accepted, budget in zip(drafted_t, accepted_t, budgets):
        context = prompt_len - 1 + committed  # cached positions when the round's forward runs
        draft, verify = round_parts(costs, option.proposer, drafted, budget, context)
        if budget > 0:
            draft, setup = draft + setup, 0.0
        units.append(draft + verify + costs.overhead_s + costs.serving_s)
        draft_total += draft
        verify_total += verify
        hist[accepted] += 1
        for j in range(max(drafted, budget)):
            if j <= accepted:
                reach_pp[j] += 1
            if j < accepted:
                acc_pp[j] += 1
        committed = min(output_len, committed + accepted + 1)
    return Profile(units=tuple(units), first=first, tokens=output_len, verify_ct=len(accepted_t),
                   accepted=sum(accepted_t), histogram=tuple(hist), accepted_per_position=tuple(acc_pp),
                   reached_per_position=tuple(reach_pp), draft_s=draft_total, verify_s=verify_total)
