"""Admission and each step's composition in plain Python (no torch), for the engine and the replay simulator.

- At most ``max_running`` sequences decode at once; the rest wait in FIFO order.
- KV capacity: a sequence reserves its worst case (prompt + max_new_tokens + k_max + 1 positions) at
  admission, so a running sequence can never run out of cache mid-request. A request whose worst case
  exceeds the whole capacity is refused at submission (``AdmissionError``) instead of waiting forever.
- Fairness: every decoding sequence rounds once per step; admitted prompts prefill, shortest left first, in
  what the rounds leave of the step's token budget.
- A step's composition is a pure function of the running sequences' states (:class:`SeqState`, in running
  order), in two stages because a round's width is chosen between them (a controller and a proposer pick k):
  :func:`plan_rounds` (who rounds, whose drafts are planned jointly), then :func:`plan_prefills` on what the
  rounds left of ``max_batch_tokens``. ``Engine._schedule`` and the simulator (``replay/sim.py``) both call
  them, so replay cannot drift from the engine's scheduling.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from backends.engine.sequence import AdmissionError, Sequence, Status

__all__ = ["AdmissionError", "Prefills", "Rounds", "Scheduler", "SeqState", "plan_prefills", "plan_rounds"]


@dataclass(frozen=True, slots=True)
class SeqState:
    """What a step's composition reads of one running sequence: the engine's Sequence and Slot
    (``Engine._states``), the simulator's Flight (``replay/sim.py``)."""

    decoding: bool  # its prompt is prefilled: it rounds every step
    prompt_left: int = 0  # prompt tokens still to prefill: all but the last, which its first round feeds
    joint: bool = False  # its drafts may be planned with the step's others (``Engine._joint``)


@dataclass(frozen=True, slots=True)
class Rounds:
    """A step's rounds, by position in the running list. ``decoding``: every decoding sequence rounds, in
    running order (the forward's order). ``joint``: those whose drafts one joint plan allocates
    (``Engine._plan_jointly`` over ``len(decoding)`` sequences), when two or more are eligible, else none (one
    alone chooses with its own controller); they are planned after the others, whose widths price the step.
    ``prefilling``: some sequence still prefills (then :func:`plan_prefills`)."""

    decoding: tuple[int, ...]
    joint: tuple[int, ...] = ()
    prefilling: bool = False


@dataclass(frozen=True, slots=True)
class Prefills:
    """A step's prefill chunks, ``(position, tokens)`` in feeding order, and the prefilling sequences with no
    prompt left to prefill (a one-token prompt), which decode from the next step."""

    chunks: tuple[tuple[int, int], ...]
    ready: tuple[int, ...] = ()


def plan_rounds(states: list[SeqState]) -> Rounds:
    """Every decoding sequence rounds; the joint ones are planned together only when two or more."""
    decoding = tuple([i for i, state in enumerate(states) if state.decoding])
    joint = [i for i in decoding if states[i].joint]
    return Rounds(decoding, tuple(joint) if len(joint) > 1 else (), len(decoding) < len(states))


def plan_prefills(states: list[SeqState], left: int, prefill_chunk: int) -> Prefills:
    """The step's prefill chunks within the ``left`` tokens the rounds left of ``max_batch_tokens`` (rounds are
    never cut; ``left`` may be negative): each prefilling prompt at most ``prefill_chunk`` tokens, shortest
    remaining prompt first (running, i.e. admission, order among equals: a stable sort), so a short prompt is
    not queued behind long ones that fill the budget. A long prompt cannot starve: only admitted prompts
    prefill (``max_running_requests``), and one fed whole decodes from the next step. Against admission order on
    the real model, mixed workload, ngram-k4 at c4: 45 of 60 requests within the SLO against 41, TTFT p90 -12%
    (docs/runs/2026-12-05-issue26-onednn/README.md, "The c4 goodput miss")."""
    chunks, ready = [], []
    prefilling = [i for i, state in enumerate(states) if not state.decoding]
    for i in sorted(prefilling, key=lambda i: states[i].prompt_left):
        need = states[i].prompt_left
        if not need:
            ready.append(i)
            continue
        tokens = min(need, prefill_chunk, left)
        if tokens > 0:
            chunks.append((i, tokens))
            left -= tokens
    return Prefills(tuple(chunks), tuple(ready))


@dataclass(slots=True)
class Scheduler:
    max_running: int
    max_total_tokens: int
    max_waiting: int = 1024
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    reserved: int = 0

    def check(self, seq: Sequence) -> None:
        if seq.reserved_tokens > self.max_total_tokens:
            raise AdmissionError(
                f"request needs up to {seq.reserved_tokens} KV tokens (prompt + max_new_tokens + draft) "
                f"but the worker's capacity is {self.max_total_tokens}; lower max_new_tokens or shorten "
                "the prompt"
            )
        if len(self.waiting) >= self.max_waiting:
            raise AdmissionError(f"waiting queue is full ({self.max_waiting} requests); retry later")

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        admitted = []
        while (self.waiting and len(self.running) < self.max_running
               and self.reserved + self.waiting[0].reserved_tokens <= self.max_total_tokens):
            seq = self.waiting.popleft()
            seq.status = Status.PREFILL
            self.reserved += seq.reserved_tokens
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.reserved -= seq.reserved_tokens
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def find(self, rid: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.rid == rid:
                return seq
        return None

    @property
    def used_tokens(self) -> int:
        return sum(seq.cache_len for seq in self.running)
