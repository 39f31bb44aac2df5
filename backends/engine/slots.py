"""A running sequence's tensor-side state (``work.Slot``), made from its request when it arrives and given back
when it finishes, and the engine-wide parts its proposer and controller draw on, each made on first use: the
suffix trees (one global tree per scope), the draft model (the target's first layers) and the pooled per-round
controllers. Apart from ``engine.py``, whose step loop only uses slots."""

from __future__ import annotations

import secrets
import zlib

import torch

from backends.engine.adaptive import controller_for
from backends.engine.config import EngineConfig
from backends.engine.proposers.base import SequenceProposer
from backends.engine.proposers.draft_model import DraftModelProposer
from backends.engine.proposers.hybrid import HybridProposer
from backends.engine.proposers.ngram import NgramProposer
from backends.engine.proposers.suffix import SuffixStore
from backends.engine.runner import ModelRunner
from backends.engine.sampling import PenaltyState, needs_history
from backends.engine.sequence import Sequence
from backends.engine.source_choice import rule_for
from backends.engine.step_costs import StepCosts
from backends.engine.work import OutputCallback, Slot

TREE_FED = ("suffix", "hybrid")  # proposers whose own answers enter the suffix trees as they commit


class SlotMaker:
    """Makes and releases slots; owns the suffix trees, the draft model and the pooled controllers."""

    def __init__(self, runner: ModelRunner, config: EngineConfig) -> None:
        self.runner, self.config = runner, config
        self._draft_runner: ModelRunner | None = None
        self._suffix_store: SuffixStore | None = None
        self.shared_controllers: dict = {}  # engine-wide per-round controllers (adaptive.controller_for)

    @property
    def draft_runner(self) -> ModelRunner:
        if self._draft_runner is None:
            self._draft_runner = self.runner.truncated(self.config.draft_layers)
        return self._draft_runner

    @property
    def suffix_store(self) -> SuffixStore:
        """The suffix proposer's trees, one global tree per scope (created on first use)."""
        if self._suffix_store is None:
            self._suffix_store = SuffixStore(self.config.suffix)
        return self._suffix_store

    def new(self, seq: Sequence, on_output: OutputCallback, costs: StepCosts) -> Slot:
        """``costs``: what the controller prices rounds with, the engine's at this moment (a test or a calibration
        may have replaced them since the engine was built)."""
        params, spec = seq.request.sampling, seq.request.speculation
        generator = torch.Generator()
        generator.manual_seed(params.sampling_seed if params.sampling_seed is not None
                              else secrets.randbits(63))
        penalty = PenaltyState.create(seq.prompt_ids, self.runner.vocab_size) if needs_history(params) else None
        proposer: SequenceProposer | None = None
        if spec.proposer == "ngram":
            proposer = NgramProposer(spec.ngram_min, spec.ngram_max, spec.ngram_match)
        elif spec.proposer == "suffix":
            proposer = self.suffix_store.open(spec.scope, list(seq.prompt_ids))
        elif spec.proposer == "draft_model":
            proposer = DraftModelProposer(self.draft_runner, seq.stop_token_ids)
        # the controller's draws are its own: seeded by the request's sampling seed, else by its id, so a
        # greedy request's rounds are reproducible (its output never depends on them)
        seed = params.sampling_seed if params.sampling_seed is not None else zlib.crc32(seq.rid.encode())
        name = spec.proposer
        round_costs = lambda k_max: [costs.round_s(name, k) for k in range(k_max + 1)]  # noqa: E731
        adaptive = None
        if spec.proposer == "hybrid":  # its rule is its controller (source_choice.py), adaptive or not
            proposer = HybridProposer(NgramProposer(spec.ngram_min, spec.ngram_max, spec.ngram_match),
                                      self.suffix_store.open(spec.scope, list(seq.prompt_ids)),
                                      rule_for(spec, round_costs, seed, self.shared_controllers))
        elif proposer is not None and spec.adaptive:
            adaptive = controller_for(spec, round_costs, seed=seed, shared=self.shared_controllers)
        return Slot(cache=self.runner.new_cache(seq.reserved_tokens), generator=generator, penalty=penalty,
                    proposer=proposer, adaptive=adaptive, on_output=on_output)

    def release(self, seq: Sequence, slot: Slot) -> None:
        """A finished sequence's slot: its proposer let go, its answer into its scope's suffix tree."""
        if slot.proposer is not None:
            slot.proposer.release()
        if self._suffix_store is not None and (slot.proposer is None or slot.proposer.name not in TREE_FED):
            # once this engine drafts from suffix trees, every answer joins its scope's tree, whatever served
            # it: the tree is the scope's outputs, not only those suffix decoding served (gateway's auto may
            # serve a scope's requests from several pools of this worker)
            self._suffix_store.remember(seq.request.speculation.scope, list(seq.prompt_ids), list(seq.output_ids))

    def end_step(self) -> None:
        """The pooled controllers close the step (their per-step evidence)."""
        for controller in self.shared_controllers.values():
            controller.end_step()
