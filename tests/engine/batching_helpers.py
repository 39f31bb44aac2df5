"""Helpers of the batching tests (tests/engine/test_batching.py): the prompts they feed and a log of what each
engine step scheduled and fed."""

from __future__ import annotations

from backends.engine.sequence import Status
from backends.engine.types import GenerateRequest, SamplingParams
from tests.engine.engine_helpers import CacheRecorder

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


def prompt(n: int, start: int) -> tuple[int, ...]:
    return tuple(start + (i % 7) * 13 + (i // 7) for i in range(n))


class StepLog:
    """Per ``engine.step()``: who was running when the step was scheduled, what each fed, and how many target
    forwards the step made (a CacheRecorder on the target runner counts them)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.recorder = CacheRecorder(engine.runner)
        self.steps: list[dict] = []
        self._schedule = engine._schedule
        engine._schedule = self._record  # the instance attribute shadows the method

    def _record(self):
        running = [seq for seq in self.engine.scheduler.running]
        works = self._schedule()
        self.steps.append({
            "running": [seq.rid for seq in running],
            "caches": {id(self.engine._slots[seq.rid].cache) for seq in running},
            "works": [(w.seq.rid, w.seq.status, len(w.feed)) for w in works],
            "forwards": len(self.recorder.batches),
        })
        return works

    def step(self) -> bool:
        busy = self.engine.step()
        step = self.steps[-1]
        step["forwards"] = len(self.recorder.batches) - step["forwards"]
        step["batch"] = self.recorder.batches[-1] if step["forwards"] else 0  # sequences in its last forward
        step["fed"] = {cache for cache, _ in self.recorder.fed[len(self.recorder.fed) - step["batch"]:]}
        return busy

    def submit(self, requests) -> dict[str, list]:
        events: dict[str, list] = {}
        for request in requests:
            events[request.rid] = []
            self.engine.submit(request, events[request.rid].append)
        return events


THREE_PROMPTS = (("a", 60, 300), ("b", 50, 700), ("c", 10, 1100))  # rid, prompt length, first id


def feed_three_prompts(engine) -> tuple[list[GenerateRequest], dict[str, list], list[list], list[list]]:
    """a (59 tokens to prefill), b (49) and c (9), admitted in that order, run to the end: (requests, their
    events, per step the prefill chunks as (rid, tokens), per step the rids that decoded a round)."""
    log = StepLog(engine)
    requests = [GenerateRequest(rid=rid, input_ids=prompt(n, start), sampling=GREEDY)
                for rid, n, start in THREE_PROMPTS]
    events = log.submit(requests)
    while log.step():
        pass
    chunks = [[(rid, n) for rid, status, n in step["works"] if status is Status.PREFILL] for step in log.steps]
    rounds = [sorted(rid for rid, status, _ in step["works"] if status is Status.DECODE) for step in log.steps]
    return requests, events, chunks, rounds
