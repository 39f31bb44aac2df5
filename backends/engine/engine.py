"""The embedded speculative engine: schedule -> run -> postprocess, one round per sequence per turn.

``Engine.step()`` is the whole algorithm; ``start()`` runs it on a background thread so an asyncio
server never blocks on the model. Requests arrive through ``submit`` (thread-safe) with a callback
that receives a ``RequestOutput`` after every round; ``abort`` stops one at its next turn.

A round (``_round``): the proposer drafts k tokens from the committed context; the target scores
``[last_committed, d_1..d_k]`` in ONE forward; ``verify`` accepts a prefix and adds the recovered or
bonus token; the sequence commits them through its stop checks; the cache is cropped back to the
committed length - 1. With proposer ``none`` (k = 0) this is exactly plain decoding, the reference.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from backends.engine.adaptive import StepCosts, controller_for, match_context
from backends.engine.config import EngineConfig
from backends.engine.proposers.base import EMPTY, SequenceProposer
from backends.engine.proposers.draft_model import DraftModelProposer, layer_truncated_draft
from backends.engine.proposers.ngram import NgramProposer
from backends.engine.proposers.suffix import SuffixStore
from backends.engine.runner import ModelRunner, load_model
from backends.engine.sampling import (
    PenaltyState, needs_history, probs_from_logits, process_logits, token_logprobs,
)
from backends.engine.scheduler import AdmissionError, Scheduler
from backends.engine.sequence import Sequence, Status
from backends.engine.types import (
    MAX_DRAFT_TOKENS, MAX_TOP_LOGPROBS, EngineLoad, FinishReason, GenerateRequest, RequestOutput, RoundStats,
    TokenLogprob,
)
from backends.engine.verify import verify_greedy, verify_sampled

log = logging.getLogger("specgate.engine")
OutputCallback = Callable[[RequestOutput], None]
CALIBRATION_WIDTHS = (1, 2, 3, 5, 9, 17)  # others interpolate (adaptive.StepCosts.forward)


@dataclass(slots=True)
class _Slot:
    """Tensor-side state of one running sequence (the Sequence itself holds no torch objects)."""

    cache: object
    generator: torch.Generator
    penalty: PenaltyState | None
    proposer: SequenceProposer | None
    adaptive: object | None  # a controller of backends/engine/adaptive.py
    on_output: OutputCallback


class Engine:
    def __init__(self, config: EngineConfig, *, model=None, tokenizer=None) -> None:
        from transformers import AutoTokenizer

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(config.model_path, local_files_only=True)
        self.runner = ModelRunner(model if model is not None else load_model(config.model_path, config.dtype))
        self.context_length = self.runner.context_length
        eos = getattr(self.runner.model.config, "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos_ids)
        self.costs = StepCosts()
        self.scheduler = Scheduler(config.max_running_requests, config.max_total_tokens,
                                   config.max_waiting_requests)
        self._draft_runner: ModelRunner | None = None
        self._suffix_store: SuffixStore | None = None
        self._slots: dict[str, _Slot] = {}
        self._shared_controllers: dict = {}  # engine-wide per-round controllers (adaptive.controller_for)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if config.calibrate:
            self.calibrate()

    # ---- public API (thread-safe) -------------------------------------------------------------
    def submit(self, request: GenerateRequest, on_output: OutputCallback) -> None:
        """Queue a request; raises AdmissionError/ValueError at once if it can never run."""
        seq = self._new_sequence(request)
        self.scheduler.check(seq)
        self._inbox.put(("add", seq, on_output))
        self._wake.set()

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid, None))
        self._wake.set()

    def ping(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the engine thread) at the loop's next intake: proves the step loop turns
        without running the model (a cheap liveness check for an idle worker)."""
        self._inbox.put(("ping", None, callback))
        self._wake.set()

    def load(self) -> EngineLoad:
        s = self.scheduler
        return EngineLoad(num_running_reqs=len(s.running), num_waiting_reqs=len(s.waiting) + self._inbox.qsize(),
                          num_used_tokens=s.used_tokens, max_total_num_tokens=s.max_total_tokens,
                          max_running_requests=s.max_running)

    def generate(self, request: GenerateRequest) -> RequestOutput:
        """Blocking convenience for tests and benchmarks: the final output of one request."""
        done = threading.Event()
        final: list[RequestOutput] = []

        def on_output(out: RequestOutput) -> None:
            if out.finished:
                final.append(out)
                done.set()

        self.submit(request, on_output)
        if self._thread is None:
            while not done.is_set():
                self.step()
        else:
            done.wait()
        return final[0]

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="specgate-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # ---- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.step():
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def step(self) -> bool:
        """One scheduling turn: intake, admit, one unit of work per running sequence. True if busy."""
        self._drain_inbox()
        for seq in self.scheduler.admit():
            seq.stats.queue_s = time.perf_counter() - seq.submitted_at
        batch = len(self.scheduler.running)
        for seq in list(self.scheduler.running):
            slot = self._slots[seq.rid]
            try:
                if seq.status is Status.PREFILL:
                    self._prefill(seq, slot)
                else:
                    self._round(seq, slot, batch)
            except Exception as exc:  # a bug in one request must not take the worker down
                log.exception("request %s failed", seq.rid)
                seq.finish = FinishReason(type="abort", message=f"internal error: {exc}", status_code=500)
            if seq.finish is not None:
                self._finish(seq)
        for controller in self._shared_controllers.values():
            controller.end_step()
        return bool(self.scheduler.running or self.scheduler.waiting)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item, on_output = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "ping":
                on_output()
            elif kind == "add":
                self._slots[item.rid] = self._new_slot(item, on_output)
                self.scheduler.waiting.append(item)
            elif (seq := self.scheduler.find(item)) is not None:
                seq.finish = FinishReason(type="abort", message="aborted by request", status_code=499)
                self._finish(seq)

    def _prefill(self, seq: Sequence, slot: _Slot) -> None:
        target = len(seq.prompt_ids) - 1  # the last prompt token is fed by the first round
        end = min(target, seq.prefilled + self.config.prefill_chunk)
        request = seq.request
        scored = request.prompt_logprobs
        if scored and seq.prefilled == 0:
            seq.prompt_logprobs.append(TokenLogprob(seq.prompt_ids[0], None))
        if end > seq.prefilled:
            fed = list(seq.prompt_ids[seq.prefilled:end])
            forward = self.runner.forward(slot.cache, fed, keep=len(fed) if scored else 1)
            if scored:  # position i predicts prompt token i + 1; no penalties: nothing is generated yet
                scaled = process_logits(forward.logits, request.sampling, None, [], seq.stop_token_ids)
                nxt = list(seq.prompt_ids[seq.prefilled + 1:end + 1])
                seq.prompt_logprobs.extend(token_logprobs(scaled, nxt, request.logprobs or 0))
        seq.prefilled = seq.cache_len = end
        if end == target:
            seq.status = Status.DECODE

    def _round(self, seq: Sequence, slot: _Slot, batch: int = 1) -> None:
        started = time.perf_counter()
        params = seq.request.sampling
        k, proposal, controller = 0, EMPTY, slot.adaptive
        context = seq.context
        if slot.proposer is not None:
            k_cap = max(0, min(seq.request.speculation.draft_tokens, seq.remaining - 1))
            if controller is not None and slot.proposer.prefix_drafts:  # draft first, then pick k knowing it
                if k_cap:
                    proposal = slot.proposer.propose(context, k_cap, params, slot.penalty, slot.generator)
                k = controller.choose(batch, match_context(proposal.match), cap=len(proposal.tokens))
                if k < len(proposal.tokens):
                    proposal = replace(proposal, tokens=proposal.tokens[:k])
            else:
                k = max(0, min(controller.choose(batch) if controller else k_cap, k_cap))
                proposal = slot.proposer.propose(context, k, params, slot.penalty, slot.generator) if k else EMPTY
        drafts = proposal.tokens
        feed = [context[-1], *drafts]
        forward = self.runner.forward(slot.cache, feed, keep=len(feed))
        scaled = process_logits(forward.logits, params, slot.penalty, drafts, seq.stop_token_ids)
        if params.greedy:
            verdict = verify_greedy(scaled, drafts)
        else:
            probs = probs_from_logits(scaled, params)
            verdict = verify_sampled(probs, proposal.draft_probs, drafts, slot.generator)
        committed = seq.commit(verdict.tokens)
        if seq.request.logprobs is not None:
            seq.logprobs.extend(token_logprobs(scaled, committed, seq.request.logprobs))
        if slot.penalty is not None:
            slot.penalty.commit(committed)
        seq.cache_len = len(seq.prompt_ids) + len(seq.output_ids) - 1
        self.runner.rollback(slot.cache, seq.cache_len)
        self.costs.observe_forward(len(feed), forward.seconds)
        if slot.proposer is not None:
            self.costs.observe_draft(slot.proposer.name, len(drafts), proposal.seconds)
            slot.proposer.observe(len(drafts), verdict.accepted, seq.context)
            if controller is not None:
                controller.observe(len(drafts), verdict.accepted, match_context(proposal.match))
        elapsed = time.perf_counter() - started
        self.costs.observe_overhead(max(0.0, elapsed - proposal.seconds - forward.seconds))
        seq.stats.record(RoundStats(
            k=len(drafts), accepted=verdict.accepted, budget=k, committed=len(committed), bonus=verdict.bonus,
            draft_s=proposal.seconds, verify_s=forward.seconds,
            overhead_s=max(0.0, elapsed - proposal.seconds - forward.seconds)))
        seq.stats.completion_tokens = len(seq.output_ids)
        if seq.stats.first_token_s is None:
            seq.stats.first_token_s = time.perf_counter() - seq.submitted_at
        if seq.finish is None:
            self._emit(seq, slot)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        slot = self._slots.pop(seq.rid, None)
        seq.stats.completion_tokens = len(seq.output_ids)
        seq.stats.e2e_s = time.perf_counter() - seq.submitted_at
        if slot is not None:
            if slot.proposer is not None:
                slot.proposer.release()
            self._emit(seq, slot)

    @staticmethod
    def _emit(seq: Sequence, slot: _Slot) -> None:
        try:
            slot.on_output(seq.event())
        except Exception:  # a consumer that went away must not stop the engine
            log.exception("output callback for %s failed", seq.rid)

    # ---- construction helpers -----------------------------------------------------------------
    def _new_sequence(self, request: GenerateRequest) -> Sequence:
        if not request.input_ids:
            raise ValueError("input_ids is empty; send at least one token")
        if len(request.input_ids) >= self.context_length:
            raise AdmissionError(
                f"prompt has {len(request.input_ids)} tokens but the model's context window is "
                f"{self.context_length}; shorten the prompt")
        vocab = self.runner.vocab_size
        if any(not 0 <= t < vocab for t in request.input_ids):
            raise ValueError(f"input_ids must be token ids in [0, {vocab})")
        if request.logprobs is not None and not 0 <= request.logprobs <= min(MAX_TOP_LOGPROBS, vocab):
            raise ValueError(f"logprobs must be in [0, {min(MAX_TOP_LOGPROBS, vocab)}], got {request.logprobs}")
        if request.prompt_logprobs and request.logprobs is None:
            raise ValueError("prompt_logprobs needs logprobs (the number of alternatives per token)")
        params = request.sampling
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
        k_max = request.speculation.draft_tokens if request.speculation.proposer != "none" else 0
        need = min(len(request.input_ids) + params.max_new_tokens, self.context_length) + k_max + 1
        return Sequence(request=request, decode=self._decode, stop_token_ids=frozenset(stops),
                        context_length=self.context_length, reserved_tokens=need)

    def _new_slot(self, seq: Sequence, on_output: OutputCallback) -> _Slot:
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
        adaptive = None
        if proposer is not None and spec.adaptive:
            name = spec.proposer
            # the controller's draws are its own: seeded by the request's sampling seed, else by its id, so a
            # greedy request's rounds are reproducible (its output never depends on them)
            seed = params.sampling_seed if params.sampling_seed is not None else zlib.crc32(seq.rid.encode())
            adaptive = controller_for(spec, lambda k: self.costs.round_s(name, k), seed=seed,
                                      shared=self._shared_controllers)
        return _Slot(cache=self.runner.new_cache(), generator=generator, penalty=penalty,
                     proposer=proposer, adaptive=adaptive, on_output=on_output)

    @property
    def draft_runner(self) -> ModelRunner:
        if self._draft_runner is None:
            self._draft_runner = ModelRunner(layer_truncated_draft(self.runner.model, self.config.draft_layers))
        return self._draft_runner

    @property
    def suffix_store(self) -> SuffixStore:
        """The suffix proposer's trees, one global tree per scope (created on first use)."""
        if self._suffix_store is None:
            self._suffix_store = SuffixStore(self.config.suffix)
        return self._suffix_store

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def calibrate(self, context: int = 32, repeats: int = 1) -> None:
        """Measure one target forward per width (feeds the adaptive controller's cost model)."""
        prompt = list(range(100, 100 + context))
        for width in CALIBRATION_WIDTHS:
            if width > MAX_DRAFT_TOKENS + 1:
                break
            for _ in range(repeats):
                cache = self.runner.new_cache()
                self.runner.forward(cache, prompt, keep=1)
                self.costs.observe_forward(width, self.runner.forward(cache, prompt[:width], keep=width).seconds)
