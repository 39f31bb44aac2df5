"""What one step of the engine holds per sequence: its tensor-side state (``Slot``) and its part of the step
(``Work``). Apart from ``engine.py`` so that the fault injector (``faults.py``) can name them without a cycle."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from backends.engine.proposers.base import EMPTY, Proposal, SequenceProposer
from backends.engine.sampling import PenaltyState
from backends.engine.sequence import Sequence
from backends.engine.types import RequestOutput

OutputCallback = Callable[[RequestOutput], None]


@dataclass(slots=True)
class Slot:
    """Tensor-side state of one running sequence (the Sequence itself holds no torch objects)."""

    cache: object
    generator: torch.Generator
    penalty: PenaltyState | None
    proposer: SequenceProposer | None
    adaptive: object | None  # a controller of backends/engine/adaptive.py
    on_output: OutputCallback


@dataclass(slots=True)
class Work:
    """One sequence's part of a step: the tokens it feeds, the logits it keeps, and its round's draft."""

    seq: Sequence
    slot: Slot
    feed: list[int]
    keep: int  # logits kept (0: a round keeps one per fed token)
    proposal: Proposal = EMPTY
    budget: int = 0  # the k chosen (a proposer may find fewer drafts)
    started: float = 0.0
    lossy: bool = False  # fault injection lossy_accept: the first draft is committed unverified (faults.py)
