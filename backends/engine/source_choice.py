"""The hybrid proposer's per-round choice between its two sources, n-gram and suffix (proposers/hybrid.py).

Both sources draft every round (each costs microseconds), so the rule sees both drafts before it picks one.
Model: as for one proposer (adaptive.py), draft position j of a source's draft is accepted, given drafts
1..j-1 were, with an unknown probability a_j(c) per context c; the contexts keep the sources apart: n-gram's
is its match length (``adaptive.match_context``: 0, 1, 2, 3, 4, 8), suffix's the length of the context suffix
its tree matched (``suffix_context``: 1, 2, 3, 4, 8, 16 offset by ``SUFFIX_CONTEXTS``) and whether its tree
was unsure of the draft (arctic-inference's score, the sum of the drafted tokens' estimated probabilities,
under ``UNSURE_MEAN`` per token: on 41 traced code and tool-call requests such drafts had their first token
accepted 23% of the time against 65%, at every match length). One
:class:`~backends.engine.adaptive.BetaDraftLength` holds their Beta posteriors: the gateway's prior, the
engine's pooled evidence of ``hybrid`` across sequences, this sequence's discounted rounds.

The rule, per round, from each source's (drafts found, context):
- fixed k (``adaptive`` false): the source whose posterior-mean expected tokens E[P](min(k, found)) is higher;
  ties go to the longer draft, then to suffix. The round drafts that source's draft, all of it.
- ``adaptive`` (strategy ``beta``): Thompson sampling over (source, k): for each source draw theta from its
  context's posterior, take ``best_k`` on that source's draft (cap = its drafts found) and its rate
  (E[P](k | theta) + B - 1) / c(k), the step's committed tokens per second as adaptive.py prices it; serve
  the best rate (ties: the longer k, then suffix). Per sequence, in every step (proposers/hybrid.py says why
  not jointly with the step's others).

Full information: after the round commits, every source's draft is scored against the committed tokens
(:func:`scored`): the run of leading matches is what the target would have accepted of it, exactly under
greedy decoding; beyond the committed tokens it is censored (the positions matched count as accepted, the
next ones are not observed). So the unchosen source learns every round too, and even a plain round (k = 0)
teaches both sources' first position. Under sampling a committed token after a rejection is drawn from the
residual distribution, not p, which slightly favours the unchosen draft's next position there; it moves the
choice only, never the output (the output distribution is verification's, whichever draft is served).

Pure Python (no torch, CONTRIBUTING.md #1): the engine and replay (replay/hybrid.py) run this same class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from backends.engine.adaptive import BetaDraftLength, PooledAcceptance, best_k, expected_tokens, match_context

SOURCES = ("ngram", "suffix")  # the order every draft list follows (index 0: n-gram, 1: suffix)
SUFFIX_CONTEXTS = 32  # suffix's contexts are SUFFIX_CONTEXTS + its bucket, apart from n-gram's 0..8
UNSURE, UNSURE_MEAN = 64, 0.5  # a suffix draft whose tokens' mean estimated probability is under 0.5
DISAGREE = 128  # added to both sources' contexts when their drafts' first tokens differ (at most one is right)


def suffix_context(match_len: int, score: float = 0.0, found: int = 0, agree: int = 0) -> int:
    """The context a suffix draft's acceptance is learned under: its tree's match length in buckets 1, 2, 3,
    4 (4-7), 8 (8-15), 16 (16+), offset by ``SUFFIX_CONTEXTS``, and ``UNSURE`` added when its ``score`` over
    its ``found`` tokens averages under ``UNSURE_MEAN``, plus ``agree`` (:func:`agreement`); 0 when it found
    nothing."""
    if match_len <= 0 or found <= 0:
        return 0
    unsure = UNSURE if score < UNSURE_MEAN * found else 0
    return SUFFIX_CONTEXTS + unsure + (16 if match_len >= 16 else match_context(match_len)) + agree


def ngram_context(match: int, agree: int = 0) -> int:
    """An n-gram draft's context: its match length's bucket (``adaptive.match_context``) plus ``agree``
    (:func:`agreement`); 0 when it found nothing."""
    bucket = match_context(match)
    return bucket + agree if bucket else 0


def agreement(ngram_first: int | None, suffix_first: int | None) -> int:
    """``DISAGREE`` when both sources drafted and their first tokens differ, else 0 (None: that source found
    nothing). Disagreeing drafts are accepted far less often at every match length, and whichever is right is
    worth knowing: on the shared workloads' trace a 3-token n-gram match's first token was accepted 70% of the
    time when suffix's draft began with it and 17% when suffix's began otherwise; suffix's 4-7-token match
    81% against 47%. Drafts that agree are learned with a source drafting alone (splitting them too gave
    the same geomean and a worse tool_call cell at c4, in replay)."""
    if ngram_first is None or suffix_first is None or ngram_first == suffix_first:
        return 0
    return DISAGREE


def contexts(ngram_match: int, suffix_match: int, suffix_score: float, suffix_found: int,
             agree: int = 0) -> tuple[int, int]:
    """Each source's context, in ``SOURCES`` order; ``agree``: :func:`agreement` of the round's drafts."""
    return ngram_context(ngram_match, agree), suffix_context(suffix_match, suffix_score, suffix_found, agree)


def scored(draft: Sequence[int], committed: Sequence[int]) -> tuple[int, int]:
    """(proposed, accepted) of ``draft`` scored against the tokens a round committed, as ``Evidence.count``
    takes them: the leading run that matches; a mismatch inside the committed tokens is a rejection there, a
    run through all of them with drafts left over is censored (only the matched positions are counted)."""
    run, limit = 0, min(len(draft), len(committed))
    while run < limit and draft[run] == committed[run]:
        run += 1
    return censored(len(draft), run, len(committed))


def censored(found: int, run: int, committed: int) -> tuple[int, int]:
    """(proposed, accepted) of a draft of ``found`` tokens whose first ``run`` tokens lead the output, in a
    round that committed ``committed`` tokens (replay knows drafts by their runs: replay/hybrid.py)."""
    limit = min(found, committed)
    run = min(run, limit)
    if run == limit and run < found:  # censored: nothing is known past the committed tokens
        return run, run
    return found, run


class SourceRule:
    """The choice rule of one hybrid sequence (module docstring). ``k_max``: the request's draft_tokens;
    ``round_costs(k_max)``: seconds of a round of 0..k_max drafts (used by ``adaptive`` only); ``pooled``:
    the engine's acceptance of ``hybrid`` per context across sequences."""

    __slots__ = ("adaptive", "posterior")

    def __init__(self, k_max: int, adaptive: bool, round_costs: Callable[[int], Sequence[float]],
                 prior: tuple[float, ...] = (), seed: int = 0, pooled: PooledAcceptance | None = None) -> None:
        self.adaptive = adaptive
        self.posterior = BetaDraftLength(k_max=k_max, round_costs=round_costs, prior=prior, seed=seed,
                                         pooled=pooled)

    def choose(self, drafts: Sequence[tuple[int, int]], batch: int = 1) -> tuple[int, int]:
        """(index into ``SOURCES``, k) for a round whose sources found ``drafts``: (drafts found, context) each,
        in ``SOURCES`` order; ``batch``: the sequences of the engine step (``adaptive`` prices it)."""
        k_max = self.posterior.k_max
        best, best_key = len(drafts) - 1, None
        for i, (found, context) in enumerate(drafts):
            cap = min(found, k_max)
            if self.adaptive:
                k, value = self._drawn(context, cap, batch) if cap else (0, 0.0)
            else:
                k = cap
                value = expected_tokens(self.posterior.means(context), cap) if cap else 0.0
            key = (value, k, i)  # ties: the longer draft, then the later source (suffix)
            if best_key is None or key > best_key:
                best, best_key = i, key
        return best, best_key[1]

    def _drawn(self, context: int, cap: int, batch: int) -> tuple[int, float]:
        """Thompson draws for ``cap`` positions of ``context``, and the best k and rate ``best_k`` finds."""
        theta = self.posterior.draws(context, cap)
        costs = self.posterior.round_costs(cap)
        k = best_k(theta, cap, costs, batch - 1)
        return k, (expected_tokens(theta, k) + batch - 1) / costs[k]

    def observe(self, drafts: Sequence[tuple[Sequence[int], int]], committed: Sequence[int]) -> None:
        """One round: every source's draft, (tokens, context), scored against the ``committed`` tokens."""
        self.observe_scored([(context, *scored(tokens, committed)) for tokens, context in drafts
                             if tokens and committed])

    def observe_scored(self, drafts: Sequence[tuple[int, int, int]]) -> None:
        """One round whose drafts are already scored: (context, proposed, accepted) each (:func:`scored`)."""
        self.posterior.observe_round(drafts)


def rule_for(spec, round_costs: Callable[[int], Sequence[float]], seed: int, shared: dict) -> SourceRule:
    """The rule of a sequence speculating with ``spec`` (a SpeculationParams, proposer ``hybrid``), starting
    from the engine's pooled acceptance of ``hybrid``, which ``shared`` holds (adaptive.controller_for's dict)."""
    pooled = shared.setdefault(("pooled", "hybrid"), PooledAcceptance())
    return SourceRule(spec.draft_tokens, spec.adaptive, round_costs, prior=spec.prior, seed=seed, pooled=pooled)
