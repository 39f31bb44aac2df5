"""A request's stages as values: each stage produces one immutable value, the next stage reads it.

    Arrival -> Admitted (auth, parse, features, checks) -> Decision (policies.decide)
            -> Dispatched (pool, worker, retries, fallback) -> Relayed (usage, speculation stats, TTFT, decode time)
            -> Ending (how it ended)                         => Finished: the one final result

The values are frozen msgspec Structs: several are built per request, and a frozen dataclass costs an
``object.__setattr__`` per field. They are not tracked by the cycle collector (``gc=False``): a value refers
only to earlier stages' values and to data, never back, so none can be part of a cycle, and the collector's
young generation fills (and is walked) less often per request. ``Finished`` is the only source of what the learner sees (``outcome``:
``policies.stats.Outcome``), of what telemetry sees (``record``: ``telemetry.record.RequestRecord``) and of
what the trace recorder writes (``gateway.tracing.Recorder.finish``); the
answer's ``x-specgate-*`` headers and ``specgate`` object are derived from the same values. Nothing here
mutates anything: the owner of a request's life (``gateway.lifecycle.serve``) produces the values and
releases what it holds.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from backends.sglang.spec_stats import SpecStats
from policies.decide import Decision
from policies.features import RequestFeatures
from policies.schema import Slo
from policies.stats import Outcome
from telemetry.record import RequestRecord, Resumed

if TYPE_CHECKING:
    from gateway.errors import ApiError
    from gateway.active import Active


class Arrival(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    request_id: str
    endpoint: str  # chat | completions
    t0: float  # time.perf_counter() when the request arrived


class Admitted(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """A request that passed auth, parsing and the model/window checks (limits are taken next)."""

    arrival: Arrival
    active: Active  # the policy version it runs under, to the end, whatever reloads happen meanwhile
    route: str
    body: dict[str, Any]  # the OpenAI body as parsed, forwarded to the worker
    features: RequestFeatures
    stream: bool
    include_usage: bool
    echo: bool  # completions with echo: a stream's first text is the prompt, not a generated token
    cost_tokens: int  # reserved against the route's tokens_per_min: prompt + max_tokens (or a default)
    trace_ids: bool = False  # selected for the trace: the worker is asked for token ids (gateway/tracing.py)
    slo: Slo | None = None  # the SLO in force: its x-slo-* headers over the route's (gateway/slo_headers.py)


class Dispatched(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """Where the request was served, once a worker accepted it."""

    pool: str
    proposer: str
    draft_tokens: int
    worker: str  # URL
    rid: str  # the worker request id the gateway assigned (for /abort_request)
    retries: int
    fallback: bool  # the plain fallback served it (the decision's pool failed), or the decision's own flag
    fallback_note: str  # appended to the decision's reason when the fallback served it


class Relayed(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """What the worker's answer told: token counts, speculation counters, first-token time, the worker's decode
    time; for a request selected for the trace also its token ids and finish reason (None otherwise, or when
    the worker sent none)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    stats: SpecStats | None = None
    ttft_s: float | None = None  # since arrival, to the first generated content (streams only)
    # the worker's own time from its first committed token to the end (``specgate_decode_s``; specgate's
    # embedded worker sends it, a real SGLang server does not)
    decode_s: float | None = None
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None
    finish: str | None = None  # the choice's finish_reason


class Ending(msgspec.Struct, frozen=True, gc=False):
    http_status: int
    status: str  # RequestRecord.status: ok | client_error | rate_limited | upstream_error | aborted | unavailable
    error_type: str | None = None
    error_message: str | None = None

    @classmethod
    def of(cls, error: ApiError) -> Ending:
        return cls(error.status, error.status_class, error.error_type, error.message)


OK = Ending(200, "ok")
CLIENT_LEFT = Ending(499, "aborted", "ClientDisconnected", "client closed the connection before the end")
INTERNAL = Ending(500, "upstream_error", "InternalError", "gateway error")


class Finished(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """Everything known when the request ended; built once, by the owner, in its ``finally``."""

    arrival: Arrival
    route: str  # "" when refused before the route was known
    stream: bool
    admitted: Admitted | None  # None when refused before admission
    decision: Decision | None
    dispatched: Dispatched | None
    retries: int  # worker attempts beyond the first, served or not
    relayed: Relayed
    ending: Ending
    e2e_s: float
    overhead_s: float  # e2e minus the time spent awaiting workers (frozen at hand-over for whole answers)
    mean_concurrency: float  # requests in flight over its life, itself included
    slo: Slo | None  # the request's own (its x-slo-* headers over its route's): slo_met and goodput judge by it
    pair_version: str
    resumes: tuple[Resumed, ...] = ()  # tries to resume it after its worker failed mid-answer (gateway/resume.py)

    @property
    def resumed(self) -> bool:
        """Another worker continued the answer: its TPOT and counters span two workers and the gap between."""
        return any(r.outcome == "ok" for r in self.resumes)

    @property
    def ok(self) -> bool:
        return self.ending.status == "ok"

    @property
    def ttft_s(self) -> float | None:
        """Time to first token as the client saw it: a whole answer's is its e2e time."""
        return self.relayed.ttft_s if self.stream else self.e2e_s

    @property
    def tpot_source(self) -> str | None:
        """Where ``tpot_s`` comes from: ``stream``, the gateway's clock on a streamed answer (first content
        chunk to the end: the network path the client sees); ``worker``, the worker's decode time of a whole
        answer (``Relayed.decode_s``); None: no TPOT (fewer than 2 tokens, or a whole answer from a worker that
        reports no decode time)."""
        return _tpot(self)[0]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (n - 1) streamed, decode_s / (n - 1) whole."""
        return _tpot(self)[1]


def _tpot(f: Finished) -> tuple[str | None, float | None]:
    """(``Finished.tpot_source``, ``Finished.tpot_s``) in one pass (``record`` and ``outcome`` need both)."""
    r = f.relayed
    n = r.completion_tokens
    if n < 2:
        return None, None
    if f.stream:
        return (None, None) if r.ttft_s is None else ("stream", (f.e2e_s - r.ttft_s) / (n - 1))
    return (None, None) if r.decode_s is None else ("worker", r.decode_s / (n - 1))


def served_by(decision: Decision | None, dispatched: Dispatched | None) -> tuple[str, str, int]:
    """(pool, proposer, draft_tokens): where it went, else what was decided, else nothing."""
    if dispatched is not None:
        return dispatched.pool, dispatched.proposer, dispatched.draft_tokens
    if decision is not None:
        return decision.pool, decision.proposer, decision.draft_tokens
    return "", "none", 0


def reason(decision: Decision, dispatched: Dispatched | None) -> str:
    return decision.reason + (dispatched.fallback_note if dispatched else "")


def headers(arrival: Arrival, route: str, decision: Decision | None, dispatched: Dispatched | None,
            retries: int, overhead_s: float) -> dict[str, str]:
    if decision is None:
        return {"x-specgate-request-id": arrival.request_id, "x-specgate-overhead-ms": f"{overhead_s * 1e3:.3f}"}
    pool, _, k = served_by(decision, dispatched)
    return {"x-specgate-request-id": arrival.request_id, "x-specgate-overhead-ms": f"{overhead_s * 1e3:.3f}",
            "x-specgate-slice": decision.slice, "x-specgate-pool": pool, "x-specgate-rule": decision.rule,
            "x-specgate-draft-tokens": str(k), "x-specgate-route": route, "x-specgate-retries": str(retries)}


class SpecgateInfo(msgspec.Struct, frozen=True, gc=False, kw_only=True):
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
    exploration: str | None = None  # why: cold | thompson (policies.decide.Decision)
    verify_rounds: int | None = None
    accept_length: float | None = None
    accept_rate: float | None = None
    completion_tokens: int | None = None
    # auto's prediction for what it chose (None for fixed rules, bypass and explorations): speedup over plain
    # and the expected accept length behind it (the posterior mean of the acceptance curve, or the measured one)
    predicted_speedup: float | None = None
    expected_accept_length: float | None = None
    # auto's posterior-mean TPOT (ms) of every option it weighed for this request ("plain decoding",
    # "POOL k=K"); None for fixed rules and bypass
    posterior_tpot_ms: dict[str, float] | None = None
    # the answer survived its worker (gateway/resume.py): count, and each try's token, workers and outcome;
    # None when no worker failed mid-answer
    resumed: ResumedInfo | None = None


class ResumedInfo(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    count: int  # resumes that continued the answer
    steps: tuple[Resumed, ...]


_INFO = msgspec.json.Encoder()


def info_json(arrival: Arrival, route: str, decision: Decision, dispatched: Dispatched, relayed: Relayed,
              resumes: tuple[Resumed, ...] = ()) -> bytes:
    s = relayed.stats
    return _INFO.encode(SpecgateInfo(
        request_id=arrival.request_id, route=route, slice=decision.slice, pool=dispatched.pool, rule=decision.rule,
        reason=reason(decision, dispatched), proposer=dispatched.proposer, draft_tokens=dispatched.draft_tokens,
        fallback=dispatched.fallback, retries=dispatched.retries, explored=decision.explored,
        exploration=decision.exploration, verify_rounds=s.verify_ct if s else None,
        accept_length=s.accept_length if s else None, accept_rate=s.accept_rate if s else None,
        completion_tokens=relayed.completion_tokens, predicted_speedup=decision.predicted_speedup,
        expected_accept_length=decision.expected_accept_length, posterior_tpot_ms=decision.posterior_tpot_ms,
        resumed=ResumedInfo(count=sum(1 for r in resumes if r.outcome == "ok"), steps=resumes) if resumes else None))


def _positions(values: tuple[int, ...] | None) -> list[int] | None:
    return list(values) if values else None


def _learned_tpot(f: Finished, tpot: float | None) -> float | None:
    """``Finished.tpot_s`` (``tpot``); for a whole answer whose worker reports no decode time (a real SGLang
    server), e2e per token, as the learner had before workers reported it."""
    n = f.relayed.completion_tokens
    if tpot is None and not f.stream and n:
        return f.e2e_s / n
    return tpot


def _plain_tpot(s, tpot: float | None, speculative: bool) -> float | None:
    """A speculative answer's plain counterfactual TPOT: its TPOT times the worker's ``specgate_plain_ratio``
    (None where the worker sent none, as a real SGLang server)."""
    return tpot * s.plain_ratio if speculative and tpot and s and s.plain_ratio else None


def outcome(f: Finished) -> Outcome | None:
    """What the policy learner sees; None when the request never got a pool."""
    d = f.decision
    if d is None:
        return None
    pool, proposer, k = served_by(d, f.dispatched)
    if not pool:
        return None
    r = f.relayed
    s = r.stats
    tpot = _learned_tpot(f, _tpot(f)[1])
    speculative = proposer != "none" and k > 0
    return Outcome(
        route=f.route, slice=d.slice, pool=pool, pair_version=f.pair_version, proposer=proposer,
        draft_tokens=k, completion_tokens=r.completion_tokens, verify_ct=s.verify_ct if s else 0,
        correct_drafts_histogram=list(s.histogram or ()) if s else [],
        accepted_per_position=_positions(s.accepted_per_position) if s else None,
        reached_per_position=_positions(s.reached_per_position) if s else None,
        ttft_s=r.ttft_s if f.stream else None, tpot_s=tpot, e2e_s=f.e2e_s,
        concurrency=round(f.mean_concurrency), ok=f.ending.status == "ok", status=f.ending.http_status,
        draft_s=s.draft_s if s else None, verify_s=s.verify_s if s else None, timestamp=time.monotonic(),
        prompt_repeat=f.admitted.features.prompt_repeat if f.admitted is not None else None,
        plain_tpot_s=_plain_tpot(s, tpot, speculative),
        neighbour_tpot_s=s.neighbour_s / (r.completion_tokens - 1)
        if speculative and s and s.neighbour_s and r.completion_tokens >= 2 else 0.0)


def slo_met(f: Finished) -> bool | None:
    """DistServe: TTFT and TPOT both within the request's SLO (``Finished.slo``). A non-streaming client sees only the
    whole answer, so there the deadline is ttft_slo + tpot_slo * (n - 1) on the e2e time."""
    return _slo_met(f, f.ending.status == "ok", _tpot(f)[1])


def _slo_met(f: Finished, ok: bool, tpot: float | None) -> bool | None:
    """``slo_met`` given ``f.ok`` and ``f.tpot_s``, computed once by the caller."""
    slo = f.slo
    if not ok or slo is None:
        return None
    ttft_slo = slo.ttft_ms / 1e3 if slo.ttft_ms else None
    tpot_slo = slo.tpot_ms / 1e3 if slo.tpot_ms else None
    if not f.stream:
        if ttft_slo is None and tpot_slo is None:
            return None
        return f.e2e_s <= (ttft_slo or 0.0) + (tpot_slo or 0.0) * max(0, f.relayed.completion_tokens - 1)
    ttft = f.relayed.ttft_s  # Finished.ttft_s of a stream
    return (ttft_slo is None or ttft is None or ttft <= ttft_slo) and \
        (tpot_slo is None or tpot is None or tpot <= tpot_slo)


def record(f: Finished) -> RequestRecord:
    """What telemetry sees (metrics, logs, dashboard)."""
    d, s, r, slo = f.decision, f.relayed.stats, f.relayed, f.slo
    pool, proposer, k = served_by(d, f.dispatched)
    ok = f.ending.status == "ok"
    tpot_source, tpot = _tpot(f)
    return RequestRecord(
        request_id=f.arrival.request_id, route=f.route, slice=d.slice if d else "", pool=pool if d else "",
        proposer=proposer, rule=d.rule if d else "", reason=reason(d, f.dispatched) if d else "",
        draft_tokens=k, exploration=d.exploration if d else None, endpoint=f.arrival.endpoint, stream=f.stream,
        status=f.ending.status, http_status=f.ending.http_status, error_type=f.ending.error_type,
        error_message=f.ending.error_message, prompt_tokens=r.prompt_tokens, completion_tokens=r.completion_tokens,
        ttft_s=(r.ttft_s if f.stream else f.e2e_s) if ok else None, tpot_s=tpot, tpot_source=tpot_source,
        e2e_s=f.e2e_s,
        overhead_s=f.overhead_s,
        verify_ct=s.verify_ct if s else None, accept_length=s.accept_length if s else None,
        num_proposed_drafts=s.num_proposed_drafts if s else None,
        num_correct_drafts=s.num_correct_drafts if s else None,
        correct_drafts_histogram=_positions(s.histogram) if s else None,
        accepted_per_position=_positions(s.accepted_per_position) if s else None,
        reached_per_position=_positions(s.reached_per_position) if s else None,
        slo_ttft_s=slo.ttft_ms / 1e3 if slo and slo.ttft_ms else None,
        slo_tpot_s=slo.tpot_ms / 1e3 if slo and slo.tpot_ms else None, slo_met=_slo_met(f, ok, tpot),
        retries=f.retries, resumes=f.resumes, worker=f.dispatched.worker if f.dispatched else "",
        fallback=f.dispatched.fallback if f.dispatched else bool(d and d.fallback), timestamp=time.time(),
        concurrency=round(f.mean_concurrency),
        plain_tpot_s=_plain_tpot(s, tpot, proposer != "none" and k > 0))
