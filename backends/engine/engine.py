"""The embedded speculative engine: continuous batching, one target forward per scheduling step.

``Engine.step()`` is the whole algorithm, in the spirit of nano-vllm's schedule -> run -> postprocess:
- schedule (``_schedule``): every decoding sequence plans a round: its proposer drafts k tokens from the
  committed context (a draft model drafts for all its sequences in one batch per draft position), k fixed
  or chosen per round by the sequence's controller; then prefill chunks of admitted prompts, shortest
  remaining first, each at most ``prefill_chunk`` tokens, in what is left of the step's token budget
  (``max_batch_tokens``, chunked prefill mixed into decode steps);
- run: ONE packed forward (``ModelRunner.forward_batch``) scores every sequence's feed, a round's
  ``[last_committed, d_1..d_k]`` and a prefill's chunk, each against its own KV cache;
- postprocess (``_verify``): ``verify`` accepts a prefix and adds the recovered or bonus token; the sequence
  commits them through its stop checks; its cache is cut back to the committed length - 1.
With proposer ``none`` (k = 0) a round is exactly plain decoding, the reference. ``start()`` runs the loop
on a background thread so an asyncio server never blocks on the model. Requests arrive through ``submit``
(thread-safe) with a callback that receives a ``RequestOutput`` after every round; ``abort`` stops one at
the next step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from transformers import AutoTokenizer

from backends.engine.adaptive import match_context, plan_step
from backends.engine.step_costs import StepCosts
from backends.engine.startup_costs import measure_rounds, measure_steps
from backends.engine.config import EngineConfig
from backends.engine.faults import FaultInjector, verify_lossy
from backends.engine.proposers.draft_model import DraftJob, propose_batch
from backends.engine.proposers.suffix import SuffixStore
from backends.engine.runner import BatchResult, Feed, ModelRunner, load_model
from backends.engine.sampling import probs_from_logits, process_logits, token_logprobs
from backends.engine.rounds import joint, plan_round, propose
from backends.engine.scheduler import Scheduler, SeqState, plan_prefills, plan_rounds
from backends.engine.sequence import Sequence, Status, new_sequence
from backends.engine.slots import SlotMaker
from backends.engine.types import EngineLoad, FinishReason, GenerateRequest, RequestOutput, RoundStats, TokenLogprob
from backends.engine.verify import verify_greedy, verify_sampled
from backends.engine.work import OutputCallback, Slot, Work

log = logging.getLogger("specgate.engine")


class Engine:
    def __init__(self, config: EngineConfig, *, model=None, tokenizer=None) -> None:
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
        self.slot_maker = SlotMaker(self.runner, config)  # also holds suffix trees, draft model, pooled controllers
        self._slots: dict[str, Slot] = {}
        self.faults = FaultInjector(self.runner.vocab_size)  # test-only; mode "off" unless a worker sets it
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
        """One scheduling step: intake, admit, then schedule -> run -> postprocess with ONE target forward for
        every running sequence (decode rounds and prefill chunks packed together). True if busy."""
        self._drain_inbox()
        for seq in self.scheduler.admit():
            seq.stats.queue_s = time.perf_counter() - seq.submitted_at
        works = self._schedule()
        if works:
            try:
                result = self.runner.forward_batch([Feed(w.slot.cache, w.feed, w.keep or len(w.feed))
                                                     for w in works])
            except Exception as exc:  # a failed step fails its sequences, never the worker
                log.exception("step of %d sequences failed", len(works))
                for work in works:
                    self._fail(work.seq, exc)
            else:
                self.costs.observe_forward(result.tokens, result.seconds, seqs=len(works))
                for work, logits in zip(works, result.logits):
                    try:
                        if work.seq.status is Status.PREFILL:
                            self._prefilled(work, logits)
                        else:
                            self._verify(work, logits, result)
                    except Exception as exc:  # a bug in one request must not take the worker down
                        log.exception("request %s failed", work.seq.rid)
                        self._fail(work.seq, exc)
        for seq in list(self.scheduler.running):
            if seq.finish is not None:
                self._finish(seq)
        self.slot_maker.end_step()
        return bool(self.scheduler.running or self.scheduler.waiting)

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        seq.finish = FinishReason(type="abort", message=f"internal error: {exc}", status_code=500)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item, on_output = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "ping":
                on_output()
            elif kind == "add":
                self._slots[item.rid] = self.slot_maker.new(item, on_output, self.costs)
                self.scheduler.waiting.append(item)
            elif (seq := self.scheduler.find(item)) is not None:
                seq.finish = FinishReason(type="abort", message="aborted by request", status_code=499)
                self._finish(seq)

    def _schedule(self) -> list[Work]:
        """This step's work as ``scheduler.plan_rounds`` and ``plan_prefills`` compose it: a round for every
        decoding sequence (drafts proposed now, draft-model drafts in one batch; the joint ones' drafts planned
        together after the others), then prefill chunks within what the rounds left of ``max_batch_tokens``."""
        running = self.scheduler.running
        states = self._states()
        plan = plan_rounds(states)
        decoding = [running[i] for i in plan.decoding]
        works: list[Work] = []
        drafts: list[tuple[Work, DraftJob]] = []
        self.costs.step_seqs = len(decoding)  # a round's cost is the step's: it shares the others' tokens
        self.costs.step_base = max(0, len(decoding) - 1)
        joint = [running[i] for i in plan.joint]  # none when one alone: its controller's own best_k, as at c1
        jointly = {seq.rid for seq in joint}
        planned: dict[int, Work] = {}
        for seq in decoding:  # the others first: the joint plan prices the step with their widths
            if seq.rid in jointly:
                continue
            try:
                work, job = plan_round(seq, self._slots[seq.rid], len(running))
            except Exception as exc:
                log.exception("request %s failed", seq.rid)
                self._fail(seq, exc)
                continue
            planned[seq.rid] = work
            self.costs.step_base += work.budget
            if job is not None:
                drafts.append((work, job))
        planned.update(self._plan_jointly(joint, len(decoding)))
        works.extend(planned[seq.rid] for seq in decoding if seq.rid in planned)
        if drafts:
            for (work, _), proposal in zip(drafts, propose_batch([job for _, job in drafts])):
                work.proposal, work.feed = proposal, [work.feed[0], *proposal.tokens]
        self.faults.inject(works)  # test-only fault injection, "off" unless a worker sets it (faults.py)
        if plan.prefilling:
            works.extend(self._plan_prefills(states, self.config.max_batch_tokens - sum(len(w.feed) for w in works)))
        return works

    def _states(self) -> list[SeqState]:
        """What the step's composition reads of each running sequence, in running order. None has finished:
        ``_finish`` removes an aborted one at once and ``step`` every other one at its end."""
        return [SeqState(seq.status is Status.DECODE, len(seq.prompt_ids) - 1 - seq.prefilled,
                         joint(self._slots[seq.rid])) for seq in self.scheduler.running]

    def _plan_prefills(self, states: list[SeqState], left: int) -> list[Work]:
        """The step's prefill chunks (``scheduler.plan_prefills``) within the ``left`` tokens the rounds left."""
        running, prefills = self.scheduler.running, plan_prefills(states, left, self.config.prefill_chunk)
        for i in prefills.ready:
            running[i].status = Status.DECODE  # nothing to prefill (a one-token prompt): decodes from the next step
        return [self._plan_prefill(running[i], tokens) for i, tokens in prefills.chunks]

    def _plan_prefill(self, seq: Sequence, tokens: int) -> Work:
        """A chunk of ``tokens`` prompt tokens from where the sequence's prefill stands."""
        fed = list(seq.prompt_ids[seq.prefilled:seq.prefilled + tokens])
        return Work(seq, self._slots[seq.rid], fed, keep=len(fed) if seq.request.prompt_logprobs else 1)

    def _prefilled(self, work: Work, logits: torch.Tensor) -> None:
        seq, request = work.seq, work.seq.request
        end = seq.prefilled + len(work.feed)
        if request.prompt_logprobs:  # position i predicts prompt token i + 1; no penalties: nothing generated yet
            if seq.prefilled == 0:
                seq.prompt_logprobs.append(TokenLogprob(seq.prompt_ids[0], None))
            scaled = process_logits(logits, request.sampling, None, [], seq.stop_token_ids)
            nxt = list(seq.prompt_ids[seq.prefilled + 1:end + 1])
            seq.prompt_logprobs.extend(token_logprobs(scaled, nxt, request.logprobs or 0))
        seq.prefilled = seq.cache_len = end
        seq.stats.prefill_chunks += 1
        if end == len(seq.prompt_ids) - 1:
            seq.status = Status.DECODE

    def _plan_jointly(self, joint: list[Sequence], seqs: int) -> dict[int, Work]:
        """The rounds of ``joint``'s sequences, their drafts chosen together: each proposes its drafts and draws
        its controller's gains, then ``plan_step`` allocates the drafts that maximise the step's committed tokens
        per second, the step priced with the others' widths (already planned) and every round's overhead."""
        proposed = []
        for seq in joint:
            slot, started = self._slots[seq.rid], time.perf_counter()
            try:
                proposal = propose(seq, slot)
                gains = slot.adaptive.gains(match_context(proposal.match), len(proposal.tokens))
            except Exception as exc:
                log.exception("request %s failed", seq.rid)
                self._fail(seq, exc)
                continue
            proposed.append((seq, slot, proposal, gains, started))
        if not proposed:
            return {}
        costs = self.costs
        base = costs.step_base + 1 - (len(joint) - len(proposed))  # the step's tokens without joint drafts
        overhead = seqs * costs.overhead_s
        ks = plan_step([gains for *_, gains, _ in proposed], float(seqs),
                       lambda w: costs.forward(base + w, seqs) + overhead)
        works = {}
        for (seq, slot, proposal, _, started), k in zip(proposed, ks):
            if k < len(proposal.tokens):
                proposal = replace(proposal, tokens=proposal.tokens[:k])
            works[seq.rid] = Work(seq, slot, [seq.context[-1], *proposal.tokens], keep=0, proposal=proposal,
                                   budget=k, started=started)
            costs.step_base += k
        return works

    def _verify(self, work: Work, logits: torch.Tensor, step: BatchResult) -> None:
        """Postprocess a round: verify, commit through the stops, roll the cache back, record, emit."""
        forward_s = step.seconds
        seq, slot, proposal = work.seq, work.slot, work.proposal
        params = seq.request.sampling
        drafts = proposal.tokens
        scaled = process_logits(logits, params, slot.penalty, drafts, seq.stop_token_ids)
        if work.lossy:
            verdict = verify_lossy(scaled, params, proposal.draft_probs, drafts, slot.generator)
        elif params.greedy:
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
        if slot.proposer is not None:
            self.costs.observe_draft(slot.proposer.name, len(drafts), proposal.seconds)
            slot.proposer.observe(len(drafts), verdict.accepted, seq.context)
            if slot.adaptive is not None:
                slot.adaptive.observe(len(drafts), verdict.accepted, match_context(proposal.match))
        overhead = max(0.0, time.perf_counter() - work.started - proposal.seconds - forward_s)
        self.costs.observe_overhead(overhead)
        share = self.costs.plain_share(step.tokens, len(step.logits), len(drafts))
        plain_s = forward_s * share + overhead
        widened = forward_s * (1.0 - share) + proposal.seconds if drafts else 0.0
        seq.stats.record(RoundStats(
            k=len(drafts), accepted=verdict.accepted, budget=work.budget, committed=len(committed),
            bonus=verdict.bonus, draft_s=proposal.seconds, verify_s=forward_s, overhead_s=overhead, plain_s=plain_s,
            neighbour_s=(len(step.logits) - 1) * widened))
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
            self.slot_maker.release(seq, slot)
            self._emit(seq, slot)

    @staticmethod
    def _emit(seq: Sequence, slot: Slot) -> None:
        try:
            slot.on_output(seq.event())
        except Exception:  # a consumer that went away must not stop the engine
            log.exception("output callback for %s failed", seq.rid)

    # ---- construction helpers -----------------------------------------------------------------
    def _new_sequence(self, request: GenerateRequest) -> Sequence:
        return new_sequence(request, decode=self._decode, eos_ids=self.eos_ids, vocab=self.runner.vocab_size,
                            context_length=self.context_length)

    @property
    def draft_runner(self) -> ModelRunner:
        return self.slot_maker.draft_runner

    @property
    def suffix_store(self) -> SuffixStore:
        """The suffix proposer's trees, one global tree per scope (created on first use)."""
        return self.slot_maker.suffix_store

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def calibrate(self, context: int = 32, repeats: int = 1) -> None:
        """Time target forwards of several shapes, each proposer's drafts and a round's overhead into
        ``self.costs`` (startup_costs.measure_steps, startup_costs.measure_rounds)."""
        measure_steps(self.runner, self.costs, context=context, repeats=repeats)
        measure_rounds(self, context=context)
