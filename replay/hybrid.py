"""The hybrid proposer (backends/engine/proposers/hybrid.py) in replay: per output position both sources'
drafts, and a walker that runs the engine's own choice rule (backends/engine/source_choice.py) round by round.

A round starting at output position p drafts from both sources at its cap, min(k, max_new - p - 1): n-gram's
draft there is a function of the context (RoundBook.positions), suffix's also of the outputs its scope's tree
holds, so :func:`suffix_positions` walks the request through the simulated worker's suffix store at admission,
in arrival order, as suffix's own arms do (RoundBook.suffix_rounds: exact at c1, an approximation that favours
suffix under concurrency). The rule learns across requests (the engine's pooled acceptance, held in the
simulated worker's shared controllers), so even a fixed k is walked round by round.

``oracle`` (``hybrid-kN-oracle``): perfect foresight over {n-gram, suffix} x k: each round serves the source
whose draft will have the longer accepted run (ties: suffix) and the k ``best_k`` finds knowing that run, as
``ngram-kN-oracle`` does for n-gram alone (replay/walk.Clairvoyant), planned jointly with the step's other joint
rounds. The engine plans hybrid rounds per sequence (proposers/hybrid.py says why), and so does replay.
Its halves (``hybrid-kN-oracle=source``, ``=k``) know one of the two choices and leave the other to the
engine's rule (planned per sequence, as the rule is): the source with the longer run and the rule's k on that
source's draft, or the rule's source cut at its own run (no draft when the run is 0).
"""

from __future__ import annotations

from collections.abc import Sequence

from backends.engine.adaptive import best_k
from backends.engine.source_choice import agreement, censored, ngram_context, rule_for, suffix_context
from backends.engine.types import SpeculationParams
from replay.book import Option
from replay.walk import ORACLE, Walker

# per output position: drafts found, accepted run, and n-gram's match length or suffix's context
Positions = tuple[list[int], list[int], list[int]]
HALVES = ("source", "k")  # hybrid-kN-oracle=HALF: the oracle's choice of the source, or of k, the rule's other


def suffix_positions(store, scope: str, prompt: Sequence[int], output: Sequence[int], max_new: int,
                     k: int, ngram_firsts: Sequence[int | None] | None = None) -> tuple[Positions, list[int]]:
    """Per output position p: the suffix proposer's draft at the cap a round starting there has (drafts found,
    how many lead the output, its context: source_choice.suffix_context), from ``store`` (a SuffixStore), which
    then holds the request's output in ``scope``'s tree; and the two sources' :func:`agreement` there, from
    n-gram's first draft tokens (``ngram_firsts``, RoundBook.ngram_scan; None: not known, 0 everywhere). The
    engine's proposer object, fed the committed tokens one by one."""
    from backends.engine.counterfactual import GREEDY  # torch (~2 s): the gateway loads replay

    proposer = store.open(scope, list(prompt))
    context = list(prompt)
    lens, runs, found_in, agrees = [], [], [], []
    for p in range(len(output)):
        cap = min(k, max_new - p - 1)
        draft = proposer.propose(context, cap, GREEDY, None, None) if cap > 0 else None
        tokens = draft.tokens if draft is not None else []
        run = 0
        while run < len(tokens) and p + run < len(output) and tokens[run] == output[p + run]:
            run += 1
        lens.append(len(tokens))
        runs.append(run)
        agree = agreement(ngram_firsts[p], tokens[0] if tokens else None) if ngram_firsts and cap > 0 else 0
        agrees.append(agree)
        found_in.append(suffix_context(draft.suffix_match, draft.suffix_score, len(tokens), agree) if tokens else 0)
        context.append(output[p])
    proposer.observe(0, 0, context)
    proposer.release()
    return (lens, runs, found_in), agrees


class HybridWalker(Walker):
    """One request under a hybrid ``option`` (k fixed, ``beta`` or ``oracle``), from both sources' positions."""

    def __init__(self, costs, prompt_len: int, output_len: int, max_new: int, option: Option, ngram: Positions,
                 suffix: Positions, seed: int, agrees: Sequence[int] = ()) -> None:
        """``agrees``: per position, the drafts' :func:`agreement` (suffix's contexts hold it already; n-gram's
        get it here); empty: unknown (a sampled request's drawn positions), 0 everywhere."""
        super().__init__(costs, prompt_len, output_len, max_new, option, *ngram, seed=seed)
        agrees = agrees or [0] * len(ngram[2])
        self.sources = ((ngram[0], ngram[1], [ngram_context(m, a) for m, a in zip(ngram[2], agrees, strict=True)]),
                        suffix)
        self.rule = None

    def bind(self, shared: dict) -> None:
        """The engine's rule (none for the oracle; ``beta``'s for its halves), its pooled acceptance the
        simulated worker's (``shared``)."""
        if self.option.strategy != ORACLE or self.option.features:
            spec = SpeculationParams(proposer="hybrid", draft_tokens=self.option.k,
                                     adaptive=self.option.strategy in ("beta", ORACLE))
            self.rule = rule_for(spec, self._round_costs, self.seed, shared)

    @property
    def joint(self) -> bool:
        """The oracle is planned with the step's other joint rounds; the engine plans hybrid per sequence."""
        return self.option.strategy == ORACLE and not self.option.features

    def _drafts(self) -> tuple[int, list[tuple[int, int, int]]]:
        """(the round's cap, each source's (drafts found at it, accepted run, context))."""
        done = self.done
        k_cap = max(0, min(self.option.k, self.max_new - done - 1))
        return k_cap, [(min(k_cap, lens[done]), min(k_cap, lens[done], runs[done]), contexts[done])
                       for lens, runs, contexts in self.sources]

    @staticmethod
    def _foreseen(drafts: list[tuple[int, int, int]]) -> tuple[int, list[float]]:
        """The oracle's source (the longer accepted run; ties: suffix) and its gains: 1 per draft accepted."""
        pick = max(range(len(drafts)), key=lambda i: (drafts[i][1], i))
        found, run, _ = drafts[pick]
        return pick, [1.0] * run + [0.0] * (found - run)

    def gains(self) -> list[float]:
        """The oracle's known gains for the step's joint plan (its source: the longer run, as next_round's)."""
        return self._foreseen(self._drafts()[1])[1]

    def next_round(self, batch: int, planned: int | None = None) -> tuple[int, int, float]:
        self._price(batch)
        k_cap, drafts = self._drafts()
        if self.rule is None:
            pick, known = self._foreseen(drafts)
            budget = planned if planned is not None else (
                best_k(known, len(known), self._table, batch - 1) if known else 0)
        else:
            pick, k = self.rule.choose([(found, context) for found, _, context in drafts], batch)
            half = self.option.features
            if half == "source":
                pick = self._foreseen(drafts)[0]
                found, _, context = drafts[pick]
                k = self.rule.choose([(found if i == pick else 0, context) for i in range(len(drafts))], batch)[1]
            elif half == "k":
                found, run, _ = drafts[pick]
                known = [1.0] * run + [0.0] * (found - run)
                k = best_k(known, len(known), self._table, batch - 1) if known else 0
            budget = k if self.option.strategy else k_cap
        found, run, _ = drafts[pick]
        drafted = min(budget, found)
        accepted = min(drafted, run)
        if self.rule is not None and k_cap > 0:  # the engine's HybridProposer.observe: both drafts scored
            committed = min(self.output_len, self.done + accepted + 1) - self.done
            self.rule.observe_scored([(context, *censored(f, r, committed)) for f, r, context in drafts if f])
        return self._commit(drafted, accepted, budget, k_cap)
