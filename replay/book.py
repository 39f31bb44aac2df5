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
import struct
from dataclasses import dataclass

from backends.engine.adaptive import match_context
from backends.engine.types import SpeculationParams
from policies.trace import Trace, TraceRequest

Rounds = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # per round: (drafted, accepted, budget)


@dataclass(frozen=True, slots=True)
class Option:
    """One way to serve a request. ``pair``: the pair version whose match flags give ``draft_model`` its
    drafts ("" for the model-free proposers and plain)."""

    proposer: str = "none"
    k: int = 0
    pair: str = ""
    strategy: str = ""  # "": k every round; else the engine's per-round controller (adaptive.STRATEGIES), k its max
    table: tuple[tuple[int, int], ...] = ()  # strategy "vllm": (lowest batch size, k) pairs
    features: str = ""  # strategy "informed": what its rates are keyed by (RoundBook.feature_keys), "" = match

    @property
    def label(self) -> str:
        base = "plain" if self.proposer == "none" else f"{self.proposer}-k{self.k}"
        if self.features:
            return f"{base}-{self.strategy}={self.features}"
        return f"{base}-{self.strategy}" if self.strategy else base


PLAIN = Option()
NGRAM_SPAN = 16  # the longest n-gram draft replay prices (backends/engine/types.MAX_DRAFT_TOKENS)
# what replay's ``informed`` reference may key the trace's acceptance rates by, per output position (a round's
# start), all known before the round is verified: ``match`` the engine's match context (adaptive.match_context,
# what specgate's controller conditions on), ``exact`` the match length itself, ``found`` the drafts the
# proposer found (up to NGRAM_SPAN), ``slice`` the request's slice label, ``repeat`` its prompt's n-gram
# self-overlap (RequestFeatures.prompt_repeat, in tenths, -1 if not recorded: known before dispatch), ``position`` the output position in
# blocks of 16 tokens, ``request`` the request itself (in-sample: its own future rounds' rates)
FEATURES = ("match", "exact", "found", "slice", "repeat", "position", "request")


def round_budgets(rounds: tuple[tuple[int, ...], tuple[int, ...]], output_len: int, max_new: int, k: int
             ) -> tuple[int, ...]:
    """The budget each round asked for, as the engine caps it: min(k, tokens still allowed - 1)."""
    budgets, done = [], 0
    for accepted in rounds[1]:
        budgets.append(max(0, min(k, max_new - done - 1)))
        done = min(output_len, done + accepted + 1)
    return tuple(budgets)


def ngram_positions(prompt: list[int], output: list[int], ngram: tuple[int, int, str]
                    ) -> tuple[list[int], list[int], list[int]]:
    """:func:`ngram_scan` without the first tokens."""
    return ngram_scan(prompt, output, ngram)[:3]


def ngram_scan(prompt: list[int], output: list[int], ngram: tuple[int, int, str]
               ) -> tuple[list[int], list[int], list[int], list[int | None]]:
    """For every output position p: how many tokens the n-gram proposer (``ngram``: its min, max and match
    settings) drafts there (at most ``NGRAM_SPAN``), how many of them lead the committed output, and the length
    of the context suffix that found them (0: none; what the engine's per-round controller conditions on). The
    proposer's draft is a function of the context alone (``NgramProposer``: the continuation of the occurrence
    of the longest suffix of n in [min, max] tokens that ends before the last token, its earliest or its latest
    occurrence, up to k tokens), and the draft for k is the first k tokens of the draft for more, so one
    proposal per position serves every k and every round boundary (:func:`fixed_rounds` walks them). The
    occurrence is found with ``bytes.find``/``rfind`` over the ids packed 4 bytes each (C speed; the proposer's
    dict index costs ~6 ms per request in Python), at a 4-byte-aligned offset. tests/replay/test_replay_book.py
    checks the result against ``counterfactual.replay_request``, which runs the engine's own proposer round by
    round. Fourth: the draft's first token (None: no draft), which the hybrid rule compares with suffix's."""
    low, high, match = ngram
    ids = [*prompt, *output]
    data = struct.pack(f"<{len(ids)}I", *ids)
    find = data.find if match == "earliest" else data.rfind
    lens, runs, matches, firsts = [], [], [], []
    for p in range(len(output)):
        size = len(prompt) + p  # the context: prompt + output[:p]
        follow, found = -1, 0
        for n in range(min(high, size), low - 1, -1):
            needle = data[4 * (size - n):4 * size]
            at = find(needle, 0, 4 * (size - 1))  # occurrences ending before the last token
            while at >= 0 and at % 4:
                at = (data.find(needle, at + 1, 4 * (size - 1)) if match == "earliest"
                      else data.rfind(needle, 0, at + 4 * n - 1))
            if at >= 0:
                follow, found = at // 4 + n, n
                break
        length = run = 0
        if follow >= 0:
            length = min(NGRAM_SPAN, size - follow)
            while run < length and p + run < len(output) and ids[follow + run] == output[p + run]:
                run += 1
        lens.append(length)
        runs.append(run)
        matches.append(found)
        firsts.append(ids[follow] if length else None)
    return lens, runs, matches, firsts


def fixed_rounds(lens: list[int], runs: list[int], max_new: int, k: int) -> Rounds:
    """The rounds of a fixed draft length ``k`` over per-position drafts (:func:`ngram_positions`): a round at
    p asks for min(k, tokens still allowed - 1), drafts min(that, lens[p]) and accepts min(that, runs[p])."""
    n = len(lens)
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


class RoundBook:
    """Rounds per (request index, option), memoized. ``trace``: a read trace (policies.trace.read_trace)."""

    def __init__(self, trace: Trace, ngram: tuple[int, int, str] | None = None) -> None:
        """``ngram``: the workers' (min, max, match) n-gram settings (``--speculative-ngram-*``); default the
        worker's defaults."""
        spec = SpeculationParams()
        self.ngram = ngram or (spec.ngram_min, spec.ngram_max, spec.ngram_match)
        SpeculationParams(ngram_min=self.ngram[0], ngram_max=self.ngram[1], ngram_match=self.ngram[2])  # checks
        self.trace = trace
        self.requests: list[TraceRequest] = trace.requests
        self._memo: dict[tuple[int, Option], Rounds] = {}
        self._records = None
        self._rates: dict[tuple[str, Option], list[float]] = {}
        self._ngram: dict[int, tuple[list[int], list[int], list[int], list[int | None]]] = {}
        self._context_rates: dict[str, dict] = {}
        self._keys: dict[tuple[int, str], list[tuple]] = {}

    def check(self, option: Option) -> None:
        """Refuse an option the trace cannot replay, naming what to rebuild."""
        if option.proposer not in ("none", "ngram", "suffix", "hybrid", "draft_model"):
            raise ValueError(f"proposer {option.proposer!r}: replay knows none, ngram, suffix, hybrid and "
                             "draft_model")
        if option.proposer == "hybrid" and option.strategy not in ("", "beta", "oracle"):
            raise ValueError(f"{option.label}: hybrid replays with a fixed k, its engine controller (beta) or the "
                             "oracle")
        if option.strategy and option.proposer not in ("ngram", "draft_model", "hybrid"):
            raise ValueError(f"{option.label}: a per-round draft length replays with ngram and draft_model, not "
                             f"{option.proposer} (its drafts depend on the order of requests)")
        if option.proposer == "draft_model" and option.pair not in self.trace.header.pairs:
            known = ", ".join(self.trace.header.pairs) or "none"
            raise ValueError(f"draft_model pair {option.pair or '(none)'}: the trace has no match flags for it "
                             f"(it carries {known}); rebuild the trace with that pair (specgate trace build "
                             "--policy FILE or --draft-layers N)")

    def _record(self, i: int):
        from backends.engine.counterfactual import Recorded  # torch (~2 s): the gateway loads replay

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
        from backends.engine.counterfactual import MatchedDrafts, replay_request  # torch (~2 s): the gateway loads replay

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
        return result.drafted, result.accepted, round_budgets(pair, n, max_new, option.k)

    def _ngram_positions(self, i: int) -> tuple[list[int], list[int], list[int]]:
        """:func:`ngram_positions` of request ``i`` under the workers' n-gram settings, memoized."""
        return self.ngram_scan(i)[:3]

    def ngram_scan(self, i: int) -> tuple[list[int], list[int], list[int], list[int | None]]:
        """:func:`ngram_scan` of request ``i`` (its drafts' first tokens too), memoized."""
        hit = self._ngram.get(i)
        if hit is None:
            request = self.requests[i]
            hit = self._ngram[i] = ngram_scan(request.prompt_ids, request.output_ids, self.ngram)
        return hit

    def positions(self, i: int, option: Option) -> tuple[list[int], list[int], list[int]]:
        """Per output position: how many tokens ``option``'s proposer would draft there at most, how many
        of them lead the committed output, and the n-gram match length that found them (0 for draft_model).
        A round starting at p with budget b drafts min(b, lens[p]) and accepts min(that, runs[p]): any
        sequence of draft lengths replays exactly (n-gram: see :meth:`_ngram_positions`; draft_model: its
        teacher-forced greedy drafts are its argmax at every position, so the run of match flags from p is
        what a round there accepts)."""
        if option.proposer == "ngram":
            return self._ngram_positions(i)
        if option.proposer != "draft_model":
            raise ValueError(f"{option.label}: per-round draft lengths replay ngram and draft_model, not "
                             f"{option.proposer} (its drafts depend on the order of requests)")
        request = self.requests[i]
        flags = request.draft_matches.get(option.pair)
        if flags is None:
            raise ValueError(f"request {request.id!r}: no draft_matches for pair {option.pair}")
        n = len(request.output_ids)
        runs = [0] * (n + 1)
        for p in range(n - 1, -1, -1):
            runs[p] = runs[p + 1] + 1 if p < len(flags) and flags[p] == "1" else 0
        return [NGRAM_SPAN] * n, runs[:n], [0] * n

    def _ngram_rounds(self, i: int, k: int) -> Rounds:
        lens, runs, _ = self._ngram_positions(i)
        return fixed_rounds(lens, runs, self.requests[i].sampling.max_new_tokens, k)

    def suffix_rounds(self, i: int, option: Option, store) -> Rounds:
        """Suffix decoding's rounds for request ``i`` from ``store`` (a SuffixStore: one per simulated
        worker), which then holds this request's output. Called at admission: the request drafts from the
        outputs of every request admitted before it, including those still running, whose whole output the
        tree then holds while the engine's holds only their committed part (an approximation that favours
        suffix under concurrency; exact at c1)."""
        from backends.engine.counterfactual import replay_request  # torch (~2 s): the gateway loads replay

        request = self.requests[i]
        result = replay_request(store.open(request.route, list(request.prompt_ids)), self._record(i), option.k)
        pair = (result.drafted, result.accepted)
        return result.drafted, result.accepted, round_budgets(pair, len(request.output_ids),
                                                         request.sampling.max_new_tokens, option.k)

    @staticmethod
    def check_features(features: str) -> tuple[str, ...]:
        names = tuple(features.split("+")) if features else ("match",)
        unknown = [n for n in names if n not in FEATURES]
        if unknown or len(set(names)) != len(names):
            raise ValueError(f"informed={features}: features are {', '.join(FEATURES)}, each at most once, joined "
                             "by + (e.g. ngram-k16-informed=request+match)")
        return names

    def feature_keys(self, i: int, features: str = "") -> list[tuple]:
        """Per output position of greedy request ``i``: the key of ``features`` (:data:`FEATURES`, joined by +;
        "" is ``match``) that ``informed`` looks its rates up by."""
        hit = self._keys.get((i, features))
        if hit is not None:  # every walker of the request asks again, at every load and seed
            return hit
        names = self.check_features(features)
        lens, _, matches = self._ngram_positions(i)
        r = self.requests[i]
        repeat = r.features.prompt_repeat
        values = {"slice": r.slice, "request": i, "repeat": -1 if repeat is None else min(9, int(10 * repeat))}
        keys = []
        for p, (length, match) in enumerate(zip(lens, matches)):
            values.update(match=match_context(match), exact=match, found=length, position=p // 16)
            keys.append(tuple(values[n] for n in names))
        self._keys[(i, features)] = keys
        return keys

    def context_rates(self, features: str = "") -> dict[tuple, list[float]]:
        """Per key of ``features`` (:meth:`feature_keys`; default the n-gram match context,
        ``adaptive.match_context``), the conditional acceptance of draft positions 1..NGRAM_SPAN over every
        output position of every greedy request of the trace: at position p the draft holds lens[p] tokens and
        its first runs[p] are accepted. What replay's ``informed`` reference knows
        (replay/walk.Clairvoyant): the trace's own rates, in-sample, exactly. The finer the key, the
        closer to knowing each round's own outcome (``request+exact+found+position`` nearly names a round), so a
        fine key's figures say what a predictor that good would reach, not that one can be learned."""
        self.check_features(features)
        if features not in self._context_rates:
            reached: dict[tuple, list[int]] = {}
            accepted: dict[tuple, list[int]] = {}
            for i, r in enumerate(self.requests):
                if not (r.output_ids and r.sampling.greedy):
                    continue
                lens, runs, _ = self._ngram_positions(i)
                for length, run, key in zip(lens, runs, self.feature_keys(i, features)):
                    got = accepted.setdefault(key, [0] * NGRAM_SPAN)
                    seen = reached.setdefault(key, [0] * NGRAM_SPAN)
                    for j in range(min(length, run + 1)):
                        seen[j] += 1
                        got[j] += j < run
            self._context_rates[features] = {c: [a / n if n else 0.0 for a, n in zip(accepted[c], reached[c])]
                                             for c in reached}
        return self._context_rates[features]

    def position_rates(self, slice_: str, option: Option) -> list[float]:
        """Conditional acceptance per draft position (accepted_j / reached_j) of ``option`` over the greedy
        requests of ``slice_`` (the trace's label): what a sampled request's rounds are drawn from. Reached as
        the worker counts it (RequestStats.reached_per_position): position j within the round's budget and
        drafts 1..j-1 accepted, whether or not the proposer drafted there (counting only drafted positions
        over-predicts a proposer that may draft fewer, n-gram and suffix). Suffix's rounds come from one
        store fed every request in trace order (its drafts depend on what came before)."""
        key = (slice_, option)
        if key not in self._rates:
            reached, accepted = [0] * option.k, [0] * option.k
            store = None
            if option.proposer == "suffix":
                from backends.engine.proposers.suffix import SuffixStore  # torch (~2 s): the gateway loads replay

                store = SuffixStore()
            for i, r in enumerate(self.requests):
                counted = r.slice == slice_ and r.sampling.greedy
                if store is not None:  # every request feeds the tree, in order
                    rounds = self.suffix_rounds(i, option, store)
                elif counted:
                    rounds = self.rounds(i, option)
                if not counted:
                    continue
                for _, acc, budget in zip(*rounds):
                    for j in range(min(budget, acc + 1)):
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
