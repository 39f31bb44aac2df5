"""Full-information evidence for ``auto``: what every model-free option of a rule would have cost on a served
greedy request (docs/policy.md, "auto": "Every request teaches every model-free option").

A greedy answer's output ids are the same under every proposer and draft length, and a model-free proposer's
drafts are a function of the committed ids (backends/engine/counterfactual.py, proven round for round), so
the rounds a fixed n-gram or suffix option would have run on a served request follow from its prompt and
output ids. :class:`Counterfactuals` computes them (n-gram: one pass of :func:`replay.book.ngram_positions`
serves every k; suffix: the engine's own proposer over one suffix tree per scope, fed every evaluated answer
in the order they finish, as replay's suffix arms are fed in arrival order), and :func:`charged_s` prices
rounds with a cost model (a ``specgate trace calibrate`` file or a worker's live step costs). The learner
takes each option's price relative to plain decoding's on the same request, times the request's plain TPOT
(:func:`policies.stats.with_counterfactuals`), as one observation of that option: the same kind of evidence
a served request gives, so an option is known without being served and ``auto`` explores only what it
cannot evaluate (adaptive pools, draft models).

Sampled requests carry none: whether a sampled request accepts a model-free draft depends on the random
draws of its verification, not on its output alone, so they stay on bandit feedback.

The gateway (gateway/evidence.py) and replay's :class:`~replay.choosers.PolicyChooser` run this same code, so
replay measures the learning the gateway does.
"""

from __future__ import annotations

from collections.abc import Sequence

from backends.engine.types import SpeculationParams, SuffixSettings
from policies.auto import CounterfactualOption
from replay.book import Option, Rounds, fixed_rounds, ngram_positions, round_budgets
from replay.profile import CachedCosts, profile

EVALUATED = ("ngram", "suffix")  # the proposers whose fixed-k rounds follow from the ids


def charged_s(costs, prompt_len: int, output_len: int, option: Option, rounds: Rounds, batch: int) -> float:
    """Engine-seconds per output token after the first of ``rounds`` in steps of ``batch`` sequences (the
    others feeding one token each): each round's share of its step plus its seconds outside the forward, and
    what its drafts cost the step's other sequences (``auto``'s objective: a request's TPOT plus
    ``neighbour_tpot_s``). The first round, which ends with the first token, is TTFT's, as in a TPOT."""
    p = profile(costs, prompt_len, output_len, option, rounds)
    b = max(1, batch)
    per_round = costs.overhead_s + costs.serving_s
    total = 0.0
    for fed, context, serial in zip(p.fed[1:], p.context[1:], p.serial[1:]):
        if b == 1:
            step = costs.forward_s(fed, context, 1)
            plain = costs.forward_s(1, context, 1)
        else:
            one = costs.forward_s(1, context, b)
            step = (costs.forward_s(fed, context, b) + (b - 1) * one) / b
            plain = one
        total += step + serial + (b - 1) * max(0.0, step - plain + serial - per_round)
    return total / max(1, output_len - 1)


class Counterfactuals:
    """Rounds of fixed model-free options on served greedy requests. ``ngram``: the workers' (min, max,
    match) n-gram settings; the suffix trees (one per scope, the workers' default settings) hold every answer
    evaluated here, added after its own options are computed."""

    def __init__(self, ngram: tuple[int, int, str] | None = None) -> None:
        spec = SpeculationParams()
        self.ngram = ngram or (spec.ngram_min, spec.ngram_max, spec.ngram_match)
        self._store = None

    def _suffix_store(self):
        if self._store is None:
            from backends.engine.proposers.suffix import SuffixStore  # torch (~2 s): the gateway loads replay

            self._store = SuffixStore(SuffixSettings())
        return self._store

    def rounds(self, prompt: Sequence[int], output: Sequence[int], max_new: int, scope: str,
               options: Sequence[tuple[str, int]], ngram_rounds=None) -> dict[tuple[str, int], Rounds]:
        """The rounds of each (proposer, k) of ``options`` (proposers in :data:`EVALUATED`) on one answer;
        the answer then joins ``scope``'s suffix tree (whether or not a suffix option was asked).
        ``ngram_rounds(k)``: the n-gram rounds when the caller has them already (replay's RoundBook)."""
        from backends.engine.counterfactual import Recorded, replay_request  # torch (~2 s): the gateway loads replay

        prompt, output = list(prompt), list(output)
        out: dict[tuple[str, int], Rounds] = {}
        ngram = None
        record = Recorded(prompt=tuple(prompt), output=tuple(output), max_new_tokens=max_new, scope=scope)
        store = self._suffix_store()
        for proposer, k in options:
            if proposer == "ngram" and ngram_rounds is not None:
                out[proposer, k] = ngram_rounds(k)
            elif proposer == "ngram":
                if ngram is None:
                    ngram = ngram_positions(prompt, output, self.ngram)
                out[proposer, k] = fixed_rounds(ngram[0], ngram[1], max_new, k)
            elif proposer == "suffix":
                drafter = store.open(scope, prompt)
                r = replay_request(drafter, record, k)  # releases the proposer
                store.forget(drafter)  # this answer joins the tree once, below
                pair = (r.drafted, r.accepted)
                out[proposer, k] = (r.drafted, r.accepted, round_budgets(pair, len(output), max_new, k))
            else:
                raise ValueError(f"proposer {proposer!r}: full-information evidence covers {', '.join(EVALUATED)}")
        store.remember(scope, prompt, output)
        return out

    def ratios(self, costs, prompt: Sequence[int], output: Sequence[int], max_new: int, scope: str, batch: int,
               options: Sequence[CounterfactualOption], served: tuple[str, int] | None = None,
               ngram_rounds=None, memo: dict | None = None) -> tuple[dict[str, float], float | None]:
        """Each option's :func:`charged_s` over plain decoding's on this answer, by its learner label, and the
        served option's (``served``: its (proposer, fixed k) when model-free; None otherwise). ``memo``: prices
        kept by (rounds, batch) for a caller that asks about the same answer again (replay's seeds and loads)."""
        wanted = list(dict.fromkeys([(o.proposer, o.k) for o in options] + ([served] if served else [])))
        rounds = self.rounds(prompt, output, max_new, scope, wanted, ngram_rounds)
        n, m = len(output), len(prompt)
        if not isinstance(costs, CachedCosts):  # the options price the same (width, context) pairs
            costs = CachedCosts(costs)
        memo = {} if memo is None else memo

        def price(option: Option, r: Rounds) -> float:
            key = (m, n, option.proposer, r, batch, id(costs.costs))
            hit = memo.get(key)
            if hit is None:
                hit = memo[key] = charged_s(costs, m, n, option, r, batch)
            return hit

        plain = price(Option(), ((0,) * n, (0,) * n, (0,) * n))
        if plain <= 0:
            return {}, None
        ratio = {key: price(Option(key[0], key[1]), r) / plain for key, r in rounds.items()}
        return {o.label: ratio[o.proposer, o.k] for o in options}, ratio[served] if served else None

