"""The values the pair gates exchange with the gateway: a canary run's ``Verdict`` (and its ``Mismatch``), a
finished request's ``Sample``, and the ``GateEvent`` every state change produces (``gateway/gates/book.py``)."""

from __future__ import annotations

import msgspec

from telemetry.record import RequestRecord


class Mismatch(msgspec.Struct, frozen=True, kw_only=True):
    """The first place a speculative canary's greedy output left the plain reference's."""

    canary: str  # the canary's id
    position: int  # 0-based index into the output tokens
    speculative: int | None  # token id (None: the output ended there)
    plain: int | None


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """One run of the equivalence gate. ``error``: the run could not finish (a worker failed, the budget ran
    out): not a verdict on the pair; the gate stays pending and runs again after ``retry_s``."""

    passed: bool
    reason: str
    error: bool = False
    canaries: int = 0
    tokens: int = 0  # greedy output tokens compared
    mismatch: Mismatch | None = None
    sampled_p: float | None = None  # the sampled check's smallest per-position p-value (None: not run)
    sampled_positions: int = 0
    accept_length: float | None = None  # the speculative canaries' accept length (None: no round ran)
    histogram: tuple[int, ...] = ()  # the speculative canaries' rounds by accepted drafts
    seconds: float = 0.0
    worker: str = ""


class GateEvent(msgspec.Struct, frozen=True, kw_only=True):
    at: float  # time.time()
    pool: str
    key: str
    gate: str  # equivalence | serving | outcome | collapse | version
    state: str  # the pool's state after the event
    previous: str | None
    reason: str


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """What the gates need of one finished user request (``Sample.of`` its telemetry record)."""

    request_id: str
    route: str
    slice: str
    bucket: int
    pool: str | None  # the speculative pool that served it; None: served without speculation
    key: str = ""  # that pool's gate key when it was decided
    ok: bool = True
    tpot_s: float | None = None
    ttft_s: float | None = None
    slo_met: bool | None = None
    verify_ct: int = 0
    correct_drafts: int = 0
    histogram: tuple[int, ...] = ()
    completion_tokens: int = 0
    seconds: float = 0.0  # engine-side seconds of the request (e2e), the outcome gate's cost
    # continued on another worker after its own failed (gateway/resume.py): its timings and draft counters span
    # two workers and the gap between, so it is evidence for the outcome gate only
    resumed: bool = False

    @classmethod
    def of(cls, record: RequestRecord, bucket: int, key: str) -> Sample:
        """The gates' view of a request's record (built once per request, for telemetry): ``bucket`` is its
        load bucket (the learner's, from its mean concurrency), ``key`` its pool's gate key."""
        return cls(request_id=record.request_id, route=record.route, slice=record.slice, bucket=bucket,
                   pool=record.pool if record.pool and record.proposer != "none" else None, key=key,
                   ok=record.status == "ok", tpot_s=record.tpot_s, ttft_s=record.ttft_s, slo_met=record.slo_met,
                   verify_ct=record.verify_ct or 0, correct_drafts=record.num_correct_drafts or 0,
                   histogram=tuple(record.correct_drafts_histogram or ()),
                   completion_tokens=record.completion_tokens, seconds=record.e2e_s,
                   resumed=any(r.outcome == "ok" for r in record.resumes))
