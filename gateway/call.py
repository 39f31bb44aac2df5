"""One request's bookkeeping from arrival to its single record.

``Call`` accumulates what the lifecycle learns (route, decision, worker, timings, speculation stats);
``Call.finish`` is called exactly once per request, whatever happened, and feeds the policy learner
(``Outcome``) and telemetry (``RequestRecord``), releases the route's admission slot and reports
the gateway's own overhead: e2e time minus the time spent waiting on the worker.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from backends.sglang.spec_stats import SpecStats
from policies.decide import Decision
from policies.features import RequestFeatures
from policies.stats import Outcome
from telemetry.record import RequestRecord

if TYPE_CHECKING:
    from gateway.limits import RouteLimiter
    from gateway.state import Active, GatewayState


class SpecgateInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The ``specgate`` object in non-streaming bodies and the final streaming chunk."""

    request_id: str
    route: str
    slice: str
    pool: str
    rule: str
    reason: str
    proposer: str
    draft_tokens: int
    fallback: bool
    retries: int
    explored: bool = False  # the decision measured an option instead of serving the best known one (auto)
    exploration: str | None = None  # why: cold | unconfirmed | stale | slope | routine (policies.decide.Decision)
    verify_rounds: int | None = None
    accept_length: float | None = None
    accept_rate: float | None = None
    completion_tokens: int | None = None


_INFO = msgspec.json.Encoder()


@dataclass(slots=True)
class Call:
    state: GatewayState
    active: Active
    endpoint: str  # chat | completions
    t0: float = field(default_factory=time.perf_counter)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    route: str = ""
    stream: bool = False
    include_usage: bool = False
    echo: bool = False  # completions with echo: the stream's first text is the prompt, not a generated token
    features: RequestFeatures | None = None
    decision: Decision | None = None
    limiter: RouteLimiter | None = None
    reserved_tokens: int = 0
    pool: str = ""
    proposer: str = "none"
    draft_tokens: int = 0
    fallback: bool = False
    fallback_note: str = ""
    worker: str = ""
    rid: str = ""
    backend: Any = None  # the Backend that served it, until released
    retries: int = 0
    upstream_s: float = 0.0  # time spent awaiting the worker
    ttft_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stats: SpecStats | None = None
    finished: bool = False
    counted: bool = False  # counted in state.in_flight (the concurrency the policy sees)
    joined_at: float = 0.0  # monotonic time and state.busy_area() when it was counted
    joined_area: float = 0.0
    mean_concurrency: float = 1.0  # in-flight requests over its life, itself included (set by finish)
    exploring: str | None = None  # its exploration_key while counted in state.exploring
    overhead_final: float | None = None  # frozen when the answer is handed over (JSON answers)

    def overhead_s(self, now: float | None = None) -> float:
        return max(0.0, (now or time.perf_counter()) - self.t0 - self.upstream_s)

    def headers(self) -> dict[str, str]:
        d = self.decision
        out = {"x-specgate-request-id": self.request_id,
               "x-specgate-overhead-ms": f"{self.overhead_s() * 1e3:.3f}"}
        if d is not None:
            out.update({"x-specgate-slice": d.slice, "x-specgate-pool": self.pool,
                        "x-specgate-rule": d.rule, "x-specgate-draft-tokens": str(self.draft_tokens),
                        "x-specgate-route": self.route, "x-specgate-retries": str(self.retries)})
        return out

    def info_json(self) -> bytes:
        d = self.decision
        assert d is not None
        s = self.stats
        return _INFO.encode(SpecgateInfo(
            request_id=self.request_id, route=self.route, slice=d.slice, pool=self.pool, rule=d.rule,
            reason=d.reason + self.fallback_note, proposer=self.proposer,
            draft_tokens=self.draft_tokens, fallback=self.fallback, retries=self.retries, explored=d.explored,
            exploration=d.exploration,
            verify_rounds=s.verify_ct if s else None, accept_length=s.accept_length if s else None,
            accept_rate=s.accept_rate if s else None, completion_tokens=self.completion_tokens))

    def finish(self, http_status: int, status: str = "ok", *, error_type: str | None = None,
               error_message: str | None = None) -> None:
        """Record the request once: learner, telemetry, admission slot, overhead."""
        if self.finished:
            return
        self.finished = True
        if self.counted:
            left = time.monotonic()
            if left > self.joined_at:
                area = self.state.busy_area(left) - self.joined_area
                self.mean_concurrency = max(1.0, area / (left - self.joined_at))
            self.state.change_in_flight(-1, left)
            if self.exploring is not None:
                self.state.change_exploring(self.exploring, -1)
        now = time.perf_counter()
        e2e = now - self.t0
        overhead = self.overhead_final if self.overhead_final is not None else self.overhead_s(now)
        if self.limiter is not None:
            self.limiter.finish(max(0, self.reserved_tokens - self.prompt_tokens - self.completion_tokens))
        d, s, ok = self.decision, self.stats, status == "ok"
        slo = self.active.policy.route_slo(self.route) if self.route else None
        n = self.completion_tokens
        ttft = self.ttft_s if self.stream else e2e
        tpot = (e2e - ttft) / (n - 1) if self.stream and ttft is not None and n >= 2 else None
        slo_met = _slo_met(ok, self.stream, ttft, tpot, e2e, n, slo)
        if d is not None and self.pool:
            self.state.learn(Outcome(
                route=self.route, slice=d.slice, pool=self.pool,
                pair_version=self.active.pair_versions.get(self.pool, ""), proposer=self.proposer,
                draft_tokens=self.draft_tokens, completion_tokens=n,
                verify_ct=s.verify_ct if s else 0,
                correct_drafts_histogram=list(s.histogram or ()) if s else [],
                accepted_per_position=list(s.accepted_per_position) if s and s.accepted_per_position else None,
                reached_per_position=list(s.reached_per_position) if s and s.reached_per_position else None,
                ttft_s=self.ttft_s if self.stream else None,
                tpot_s=tpot if self.stream else (e2e / n if n else None), e2e_s=e2e,
                concurrency=round(self.mean_concurrency), ok=ok, status=http_status,
                draft_s=s.draft_s if s else None, verify_s=s.verify_s if s else None,
                timestamp=time.monotonic()))
        self.state.telemetry.observe(RequestRecord(
            request_id=self.request_id, route=self.route, slice=d.slice if d else "", pool=self.pool,
            proposer=self.proposer, rule=d.rule if d else "", reason=(d.reason + self.fallback_note) if d else "",
            draft_tokens=self.draft_tokens, exploration=d.exploration if d else None, endpoint=self.endpoint,
            stream=self.stream, status=status,
            http_status=http_status, error_type=error_type, error_message=error_message,
            prompt_tokens=self.prompt_tokens, completion_tokens=n, ttft_s=ttft if ok else None,
            tpot_s=tpot, e2e_s=e2e, overhead_s=overhead, verify_ct=s.verify_ct if s else None,
            accept_length=s.accept_length if s else None,
            num_proposed_drafts=s.num_proposed_drafts if s else None,
            num_correct_drafts=s.num_correct_drafts if s else None,
            correct_drafts_histogram=list(s.histogram) if s and s.histogram else None,
            accepted_per_position=list(s.accepted_per_position) if s and s.accepted_per_position else None,
            reached_per_position=list(s.reached_per_position) if s and s.reached_per_position else None,
            slo_ttft_s=slo.ttft_ms / 1e3 if slo and slo.ttft_ms else None,
            slo_tpot_s=slo.tpot_ms / 1e3 if slo and slo.tpot_ms else None, slo_met=slo_met,
            retries=self.retries, worker=self.worker, fallback=self.fallback, timestamp=time.time()))


def _slo_met(ok: bool, stream: bool, ttft: float | None, tpot: float | None, e2e: float, n: int,
             slo: Any) -> bool | None:
    """DistServe: TTFT and TPOT both within the route's SLO. A non-streaming client sees only the
    whole answer, so there the deadline is ttft_slo + tpot_slo * (n - 1) on the e2e time."""
    if not ok or slo is None:
        return None
    ttft_slo = slo.ttft_ms / 1e3 if slo.ttft_ms else None
    tpot_slo = slo.tpot_ms / 1e3 if slo.tpot_ms else None
    if not stream:
        budget = (ttft_slo or 0.0) + (tpot_slo or 0.0) * max(0, n - 1)
        return None if ttft_slo is None and tpot_slo is None else e2e <= budget
    met = True
    if ttft_slo is not None and ttft is not None:
        met = met and ttft <= ttft_slo
    if tpot_slo is not None and tpot is not None:
        met = met and tpot <= tpot_slo
    return met
