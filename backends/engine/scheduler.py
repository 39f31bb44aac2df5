"""Admission and fairness in plain Python (no torch).

- At most ``max_running`` sequences decode at once; the rest wait in FIFO order.
- KV capacity: a sequence reserves its worst case (prompt + max_new_tokens + k_max + 1 positions) at
  admission, so a running sequence can never run out of cache mid-request. A request whose worst case
  exceeds the whole capacity is refused at submission (``AdmissionError``) instead of waiting forever.
- Fairness: every running sequence gets one round (or one prefill chunk) per turn, round robin.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from backends.engine.sequence import AdmissionError, Sequence, Status

__all__ = ["AdmissionError", "Scheduler"]


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
