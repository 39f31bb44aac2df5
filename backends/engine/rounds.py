"""One decoding sequence's round planned from its slot: the draft length k (fixed, or its controller's choice) and
the drafts (model-free proposers draft now; a draft model's job is returned for the step's batch). The step's
composition, and the joint plan over the sequences ``joint`` names (``adaptive.plan_step``), stay in ``engine.py``."""

from __future__ import annotations

import time
from dataclasses import replace

from backends.engine.adaptive import BetaDraftLength, match_context
from backends.engine.proposers.base import EMPTY, Proposal
from backends.engine.proposers.draft_model import DraftJob, DraftModelProposer
from backends.engine.proposers.hybrid import HybridProposer
from backends.engine.sequence import Sequence
from backends.engine.work import Slot, Work


def joint(slot: Slot) -> bool:
    """Planned with the step's others (``adaptive.plan_step``): specgate's controller over a proposer whose drafts
    come first and cost nothing more by k (n-gram). Hybrid plans per sequence (proposers/hybrid.py)."""
    return isinstance(slot.adaptive, BetaDraftLength) and slot.proposer.prefix_drafts


def propose(seq: Sequence, slot: Slot) -> Proposal:
    """A prefix-drafting proposer's drafts for every k the round may take (its cap)."""
    k_cap = max(0, min(seq.request.speculation.draft_tokens, seq.remaining - 1))
    return slot.proposer.propose(seq.context, k_cap, seq.request.sampling, slot.penalty,
                                 slot.generator) if k_cap else EMPTY


def plan_round(seq: Sequence, slot: Slot, batch: int) -> tuple[Work, DraftJob | None]:
    """Choose k and draft (model-free proposers now; a draft model's job is returned for the batch)."""
    started = time.perf_counter()
    params = seq.request.sampling
    k, proposal, controller, job = 0, EMPTY, slot.adaptive, None
    context = seq.context
    if slot.proposer is not None:
        k_cap = max(0, min(seq.request.speculation.draft_tokens, seq.remaining - 1))
        if isinstance(slot.proposer, HybridProposer):  # both sources draft; its rule picks one (and k)
            if k_cap:
                proposal = slot.proposer.propose(context, k_cap, params, slot.penalty, slot.generator,
                                                 batch=batch)
            k = len(proposal.tokens) if seq.request.speculation.adaptive else k_cap
        elif controller is not None and slot.proposer.prefix_drafts:  # draft first, then pick k knowing it
            proposal = propose(seq, slot)
            k = controller.choose(batch, match_context(proposal.match), cap=len(proposal.tokens))
            if k < len(proposal.tokens):
                proposal = replace(proposal, tokens=proposal.tokens[:k])
        else:
            k = max(0, min(controller.choose(batch) if controller else k_cap, k_cap))
            if k and isinstance(slot.proposer, DraftModelProposer):
                job = DraftJob(slot.proposer, context, k, params, slot.penalty, slot.generator)
            elif k:
                proposal = slot.proposer.propose(context, k, params, slot.penalty, slot.generator)
    work = Work(seq, slot, [context[-1], *proposal.tokens], keep=0, proposal=proposal, budget=k, started=started)
    return work, job
