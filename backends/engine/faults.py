"""Test-only faults in speculative decoding: a speculative pool broken on purpose (``--fault-injection``).

The gateway's pair gates (canary prompts through the speculative pool must be token-identical to a plain
reference before it serves; accept length is watched live for a silent collapse) are proven against a
worker whose speculation fails in the two ways they guard against. ``FaultInjector.mode``:

- ``off``: exact speculative decoding; the engine only reads the mode once per step.
- ``lossy_accept``: each round commits its FIRST draft unverified (greedy: even when it is not argmax p_0;
  sampled: without the rejection test), then verifies the remaining drafts exactly from there
  (``verify_lossy``). Commit, the KV cache, the proposer and the stats follow the committed tokens as in
  any round: everything stays consistent, the round just commits a token plain decoding would not have
  (a lossy verification setting that changes outputs).
- ``random_draft``: every round's k drafts are replaced by k token ids drawn uniformly over the vocabulary
  from the injector's own seeded generator (``random_drafts``). Output stays exact (a draft chosen
  independently of the target, verified with q = one-hot, is verified exactly), while acceptance collapses
  to an accept length of ~1 (a mismatched draft).

Rounds without drafts (plain requests, k = 0) are never touched, in any mode.

Threads: the worker's event loop writes ``mode``, the engine thread reads it once per step
(``Engine._schedule``). Each is one store or load of an attribute holding an immutable str, atomic in
CPython, so no lock is needed; a change applies to rounds from the next step on.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from backends.engine.proposers.base import Proposal
from backends.engine.sampling import probs_from_logits
from backends.engine.types import FAULT_MODES, FaultMode, SamplingParams
from backends.engine.verify import Verdict, verify_greedy, verify_sampled

if TYPE_CHECKING:
    from backends.engine.work import Work

RANDOM_DRAFT_SEED = 0  # random drafts are reproducible run to run (the engine thread alone draws them)


class FaultInjector:
    """The engine's fault switch: ``mode`` (set through ``set``) and the generator of random drafts."""

    def __init__(self, vocab: int, seed: int = RANDOM_DRAFT_SEED) -> None:
        self.mode: FaultMode = "off"
        self.vocab = vocab
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def set(self, mode: str) -> None:
        if mode not in FAULT_MODES:
            raise ValueError(f"fault mode must be one of {', '.join(FAULT_MODES)}, got {mode!r}")
        self.mode = mode  # type: ignore[assignment]

    def inject(self, works: list[Work]) -> None:
        """Apply the mode, read once for this step, to the step's decode rounds, once their drafts exist."""
        mode = self.mode
        if mode == "off":
            return
        for work in works:
            if not work.proposal.tokens:
                continue
            if mode == "random_draft":
                work.proposal = self.random_drafts(work.proposal)
                work.feed = [work.feed[0], *work.proposal.tokens]
            elif mode == "lossy_accept":
                work.lossy = True

    def random_drafts(self, proposal: Proposal) -> Proposal:
        """As many uniformly random token ids as ``proposal`` drafted; deterministic (q = one-hot)."""
        tokens = torch.randint(self.vocab, (len(proposal.tokens),), generator=self.generator).tolist()
        return replace(proposal, tokens=tokens, draft_probs=None)


def verify_lossy(
    target_logits: torch.Tensor,  # [k + 1, vocab], processed logits (process_logits), k >= 1
    params: SamplingParams,
    draft_probs: torch.Tensor | None,  # [k, vocab], or None for a deterministic proposer
    draft_tokens: list[int],  # [k]
    generator: torch.Generator,
) -> Verdict:
    """``lossy_accept``'s verification: draft 1 is accepted unverified, drafts 2..k are verified exactly
    against target rows 1..k (which score the context with draft 1 in it, since the round fed it)."""
    first, rest = draft_tokens[0], draft_tokens[1:]
    if params.greedy:
        tail = verify_greedy(target_logits[1:], rest)
    else:
        target_probs = probs_from_logits(target_logits[1:], params)
        tail = verify_sampled(target_probs, None if draft_probs is None else draft_probs[1:], rest, generator)
    return Verdict(accepted=1 + tail.accepted, tokens=[first, *tail.tokens], bonus=tail.bonus)
