"""Hybrid: draft from n-gram prompt lookup AND suffix decoding every round, serve the one its rule picks.

Both sources cost microseconds, so every round drafts from both at the round's cap (the request's k, capped by
the tokens left) and :class:`~backends.engine.source_choice.SourceRule` picks the source, and with ``adaptive``
the k, from each draft's own signals: n-gram's match length, suffix's tree match length, the sequence's and
the engine's evidence per (source, context). Both sources observe every committed token whichever was served:
the n-gram index reads the committed context, the suffix trees (this request's and its scope's global one)
take the committed tokens. After the round the rule scores BOTH drafts against the committed tokens
(full information: the unchosen draft learns too).

Exactness is the proposer contract's (base.py): drafts are deterministic (q one-hot, ``draft_probs`` None), and
the choice reads only committed tokens and the rule's own seeded draws, never the round's verification.

Drafting comes first (``prefix_drafts``), so k is picked knowing both drafts, per sequence, by the rule with the
step's batch (``rounds.plan_round``), not by the engine's joint plan over the step (``plan_step``, which
n-gram's controller joins): the plan takes one gain curve per sequence, so the source would have to be picked
without the step's costs, by its drawn expected tokens. Tried that way (replay, 41 traced code and tool-call
requests, 3 seeds, the Xeon's costs), hybrid-k16-beta at c4 was 0.954 of suffix-k8 against 0.937 per sequence.
"""

from __future__ import annotations

import time

import torch

from backends.engine.proposers.base import Proposal, SequenceProposer
from backends.engine.proposers.ngram import NgramProposer
from backends.engine.proposers.suffix import SuffixProposer
from backends.engine.sampling import PenaltyState
from backends.engine.source_choice import SOURCES, SourceRule, agreement, contexts
from backends.engine.types import SamplingParams


class HybridProposer(SequenceProposer):
    name = "hybrid"
    prefix_drafts = True

    def __init__(self, ngram: NgramProposer, suffix: SuffixProposer, rule: SourceRule) -> None:
        self.ngram, self.suffix, self.rule = ngram, suffix, rule
        self._round: tuple[int, list[tuple[list[int], int]]] | None = None  # (context length, drafts) to score

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        penalty: PenaltyState | None,
        generator: torch.Generator,
        *,
        batch: int = 1,
    ) -> Proposal:
        """Both sources' drafts at cap ``k``; the one the rule picks for a round in a step of ``batch``
        sequences, cut to the k it picks (fixed: the whole draft)."""
        start = time.perf_counter()
        drafts = self._draft(context, k, params, penalty, generator)
        pick, chosen_k = self.rule.choose([(len(tokens), c) for tokens, c in drafts], batch)
        chosen = drafts[pick][0]
        return Proposal(tokens=chosen[:chosen_k], draft_probs=None, seconds=time.perf_counter() - start,
                        source=SOURCES[pick])

    def _draft(self, context: list[int], k: int, params: SamplingParams, penalty: PenaltyState | None,
               generator: torch.Generator) -> list[tuple[list[int], int]]:
        """Both sources' drafts at cap ``k`` with their contexts (source_choice.contexts), kept for ``observe``."""
        ngram = self.ngram.propose(context, k, params, penalty, generator)
        suffix = self.suffix.propose(context, k, params, penalty, generator)
        found = contexts(ngram.match, suffix.suffix_match, suffix.suffix_score, len(suffix.tokens),
                         agreement(ngram.tokens[0] if ngram.tokens else None,
                                   suffix.tokens[0] if suffix.tokens else None))
        drafts = [(ngram.tokens, found[0]), (suffix.tokens, found[1])]
        self._round = (len(context), drafts)
        return drafts

    def observe(self, proposed: int, accepted: int, context: list[int]) -> None:
        """Both sources see the committed context; the rule scores both drafts of the round against it."""
        self.ngram.observe(proposed, accepted, context)
        self.suffix.observe(proposed, accepted, context)
        if self._round is not None:
            start, drafts = self._round
            self._round = None
            self.rule.observe(drafts, context[start:])

    def release(self) -> None:
        self.suffix.release()
