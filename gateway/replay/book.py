"""The rounds every option would run on every traced request, exactly (greedy), computed once.

A simulated request is served by one option: plain decoding, or a proposer with a draft length k (and,
for ``draft_model``, the pair whose teacher-forced match flags the trace carries). For a greedy request the
rounds are a function of the prompt and output ids (``backends/engine/counterfactual.py``), independent of
load, arrival order and seed, so they are computed once per (request, option) and shared by every load and
seed of a sweep. Two exceptions are documented where they are handled: ``suffix`` drafts from a tree of
earlier outputs (``suffix_rounds``: computed when the request is admitted, from the outputs of the requests
admitted before it), and sampled requests, whose rounds are drawn from per-position acceptance rates
measured on the greedy requests of the same slice (:meth:`RoundBook.estimated_rounds`, labelled estimated).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from policies.trace import Trace, TraceRequest

Rounds = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # per round: (drafted, accepted, budget)


@dataclass(frozen=True, slots=True)
class Option:
    """One way to serve a request. ``pair``: the pair version whose match flags give ``draft_model`` its
    drafts ("" for the model-free proposers and plain)."""

    proposer: str = "none"
    k: int = 0
    pair: str = ""

    @property
    def label(self) -> str:
        return "plain" if self.proposer == "none" else f"{self.proposer}-k{self.k}"


PLAIN = Option()
NGRAM_SPAN = 16  # the longest n-gram draft replay prices (backends/engine/types.MAX_DRAFT_TOKENS)


def _budgets(rounds: tuple[tuple[int, ...], tuple[int, ...]], output_len: int, max_new: int, k: int
             ) -> tuple[int, ...]:
    """The budget each round asked for, as the engine caps it: min(k, tokens still allowed - 1)."""
    budgets, done = [], 0
    for accepted in rounds[1]:
        budgets.append(max(0, min(k, max_new - done - 1)))
        done = min(output_len, done + accepted + 1)
    return tuple(budgets)


class RoundBook:
    """Rounds per (request index, option), memoized. ``trace``: a read trace (policies.trace.read_trace)."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.requests: list[TraceRequest] = trace.requests
        self._memo: dict[tuple[int, Option], Rounds] = {}
        self._records = None
        self._rates: dict[tuple[str, Option], list[float]] = {}
        self._ngram: dict[int, tuple[list[int], list[int]]] = {}

    def check(self, option: Option) -> None:
        """Refuse an option the trace cannot replay, naming what to rebuild."""
        if option.proposer not in ("none", "ngram", "suffix", "draft_model"):
            raise ValueError(f"proposer {option.proposer!r}: replay knows none, ngram, suffix and draft_model")
        if option.proposer == "draft_model" and option.pair not in self.trace.header.pairs:
            known = ", ".join(self.trace.header.pairs) or "none"
            raise ValueError(f"draft_model pair {option.pair or '(none)'}: the trace has no match flags for it "
                             f"(it carries {known}); rebuild the trace with that pair (specgate trace build "
                             "--policy FILE or --draft-layers N)")

    def _record(self, i: int):
        from backends.engine.counterfactual import Recorded

        r = self.requests[i]
        return Recorded(prompt=tuple(r.prompt_ids), output=tuple(r.output_ids),
                        max_new_tokens=r.sampling.max_new_tokens, scope=r.route)

    def rounds(self, i: int, option: Option) -> Rounds:
        """The (drafted, accepted, budget) of every round ``option`` runs on greedy request ``i``."""
        key = (i, option)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._compute(i, option)
        return hit

    def _compute(self, i: int, option: Option) -> Rounds:
        from backends.engine.counterfactual import MatchedDrafts, replay_request

        request = self.requests[i]
        n, max_new = len(request.output_ids), request.sampling.max_new_tokens
        if option.proposer == "none" or option.k == 0:
            return (0,) * n, (0,) * n, (0,) * n
        if option.proposer == "ngram":
            return self._ngram_rounds(i, option.k)
        record = self._record(i)
        if option.proposer == "draft_model":
            flags = request.draft_matches.get(option.pair)
            if flags is None:
                raise ValueError(f"request {request.id!r}: no draft_matches for pair {option.pair}")
            proposer = MatchedDrafts(record, [f == "1" for f in flags], where=f"request {request.id!r}")
        else:
            raise ValueError(f"proposer {option.proposer}: use suffix_rounds (its drafts depend on the order)")
        result = replay_request(proposer, record, option.k)
        pair = (result.drafted, result.accepted)
        return result.drafted, result.accepted, _budgets(pair, n, max_new, option.k)

    def _ngram_positions(self, i: int) -> tuple[list[int], list[int]]:
        """For every output position p: how many tokens the n-gram proposer drafts there (at most
        ``NGRAM_SPAN``) and how many of them lead the committed output. The proposer's draft is a function of
        the context alone (``NgramProposer``: the continuation of the longest earlier match, up to k tokens),
        and the draft for k is the first k tokens of the draft for more, so one proposal per position serves
        every k and every round boundary: ``rounds`` then only walks the positions (tests/gateway/
        test_replay_book.py checks it against ``counterfactual.replay_request``, which runs the proposer
        round by round)."""
        hit = self._ngram.get(i)
        if hit is None:
            from backends.engine.counterfactual import GREEDY
            from backends.engine.proposers.ngram import NgramProposer
            from backends.engine.types import SpeculationParams

            spec = SpeculationParams()  # the worker's defaults (ngram_min/max/match)
            proposer = NgramProposer(spec.ngram_min, spec.ngram_max, spec.ngram_match)
            request = self.requests[i]
            output = request.output_ids
            context = list(request.prompt_ids)
            lens, runs = [], []
            for p in range(len(output)):
                draft = proposer.propose(context, NGRAM_SPAN, GREEDY, None, None).tokens
                run = 0
                while run < len(draft) and p + run < len(output) and draft[run] == output[p + run]:
                    run += 1
                lens.append(len(draft))
                runs.append(run)
                context.append(output[p])
            hit = self._ngram[i] = (lens, runs)
        return hit

    def _ngram_rounds(self, i: int, k: int) -> Rounds:
        lens, runs = self._ngram_positions(i)
        n, max_new = len(lens), self.requests[i].sampling.max_new_tokens
        drafted, accepted, budgets, done = [], [], [], 0
        while done < n:
            budget = max(0, min(k, max_new - done - 1))
            d = min(budget, lens[done])
            a = min(d, runs[done])
            drafted.append(d)
            accepted.append(a)
            budgets.append(budget)
            done = min(n, done + a + 1)
        return tuple(drafted), tuple(accepted), tuple(budgets)

    def suffix_rounds(self, i: int, option: Option, store) -> Rounds:
        """Suffix decoding's rounds for request ``i`` from ``store`` (a SuffixStore: one per simulated
        worker), which then holds this request's output. Called at admission: the request drafts from the
        outputs of every request admitted before it, including those still running, whose whole output the
        tree then holds while the engine's holds only their committed part (an approximation that favours
        suffix under concurrency; exact at c1)."""
        from backends.engine.counterfactual import replay_request

        request = self.requests[i]
        result = replay_request(store.open(request.route, list(request.prompt_ids)), self._record(i), option.k)
        pair = (result.drafted, result.accepted)
        return result.drafted, result.accepted, _budgets(pair, len(request.output_ids),
                                                         request.sampling.max_new_tokens, option.k)

    def position_rates(self, slice_: str, option: Option) -> list[float]:
        """Conditional acceptance per draft position (accepted_j / reached_j) of ``option`` over the greedy
        requests of ``slice_`` (the trace's label): what a sampled request's rounds are drawn from."""
        key = (slice_, option)
        if key not in self._rates:
            reached, accepted = [0] * option.k, [0] * option.k
            for i, r in enumerate(self.requests):
                if r.slice != slice_ or not r.sampling.greedy:
                    continue
                for drafted, acc, _ in zip(*self.rounds(i, option)):
                    for j in range(min(drafted, acc + 1)):
                        reached[j] += 1
                        accepted[j] += j < acc
            if not any(reached):
                raise ValueError(f"slice {slice_!r}: no greedy request to estimate {option.label}'s acceptance "
                                 "for its sampled requests from")
            self._rates[key] = [a / r if r else 0.0 for a, r in zip(accepted, reached)]
        return self._rates[key]

    def estimated_rounds(self, i: int, option: Option, rng: random.Random) -> Rounds:
        """Rounds of a sampled request (no exact counterfactual): each draft position accepted with its
        slice's measured conditional rate, drawn from ``rng``; the output length is the recorded one."""
        request = self.requests[i]
        n, max_new = len(request.output_ids), request.sampling.max_new_tokens
        if option.proposer == "none" or option.k == 0:
            return (0,) * n, (0,) * n, (0,) * n
        rates = self.position_rates(request.slice, option)
        drafted, accepted, budgets, done = [], [], [], 0
        while done < n:
            budget = max(0, min(option.k, max_new - done - 1))
            a = 0
            while a < budget and done + a < n and rng.random() < rates[a]:
                a += 1
            drafted.append(budget)
            accepted.append(a)
            budgets.append(budget)
            done = min(n, done + a + 1)
        return tuple(drafted), tuple(accepted), tuple(budgets)
