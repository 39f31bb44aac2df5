"""A gateway request's trace as the gateway ships it (:class:`GatewayTrace`), and its spans as the exporter process
builds them from it (:func:`spans_of`).

Why not spans: at 100% sampling the gateway's span code was ~10% of its CPU per request under load (the span
objects, their attribute dicts and the request span's ~30 attributes read one by one), on the core that serves
requests, while the exporter runs on idle time only (docs/runs/2026-12-07-otel-record). So the gateway records the
stage times, its dispatch attempts (whose span ids went to the workers in ``traceparent``) and the request's
``RequestRecord``, which it builds for telemetry anyway and msgspec encodes in C; the exporter names the spans,
gives the stage spans their ids and reads the attributes off the record. The spans are the ones the gateway
recorded itself before (gateway/request_spans.py's docstring draws them).
"""

from __future__ import annotations

import msgspec

from telemetry.otel import new_span_id
from telemetry.otel_pipe import GATEWAY_DECIDE, GATEWAY_RELAY, GATEWAY_REQUEST, INTERNAL, SERVER, WireSpan, WireTrace
from telemetry.record import RequestRecord


class GatewayTrace(msgspec.Struct, array_like=True, gc=False, tag="g"):
    """One sampled request in the gateway: the trace's ids as in :class:`WireTrace`; its own span's id; the stage
    times in ns since the epoch (0: the stage never ended: ``admit_ns``, ``decide_ns``; not served:
    ``relay_ns``); the dispatch attempts' spans; what the request asked (``max_tokens``, ``temperature``); what
    was known of it (``decided``: a decision was made; ``explored``: it explored); its record."""

    trace_hi: int
    trace_lo: int
    remote_parent: int
    remote_flags: int
    trace_state: str
    root_id: int
    start_ns: int
    admit_ns: int
    decide_ns: int
    relay_ns: int
    end_ns: int
    attempts: list[WireSpan]
    operation: str
    model: str
    max_tokens: int | None
    temperature: float | None
    decided: bool
    explored: bool
    record: RequestRecord


def spans_of(t: GatewayTrace) -> WireTrace:
    """The request's spans: admit (arrival to admission), decide, a dispatch per attempt, relay (the answer's
    hand-over or stream), each a child of the request's own span, which carries the gen_ai.* and specgate.*
    attributes; an attempt still open when the request ended ends with it."""
    spans: list[WireSpan] = []
    mark = t.start_ns
    if t.admit_ns:
        spans.append(WireSpan("admit", new_span_id(), t.root_id, INTERNAL, mark, t.admit_ns, {}))
        mark = t.admit_ns
    r = t.record
    if t.decide_ns:
        spans.append(WireSpan("decide", new_span_id(), t.root_id, INTERNAL, mark, t.decide_ns,
                              [GATEWAY_DECIDE, r.slice, r.rule]))
    for attempt in t.attempts:
        if attempt.end_ns == 0:
            attempt.end_ns = t.end_ns
        spans.append(attempt)
    served = t.relay_ns != 0
    if served:
        spans.append(WireSpan("relay", new_span_id(), t.root_id, INTERNAL, t.relay_ns, t.end_ns,
                              [GATEWAY_RELAY, r.stream]))
    decided, failed = t.decided, r.status != "ok"
    attributes = [  # in the order of LAYOUTS[GATEWAY_REQUEST] (telemetry/otel_pipe.py); None: not set
        GATEWAY_REQUEST, t.operation, "specgate", t.model or None, t.max_tokens, t.temperature,
        r.prompt_tokens if served else None, r.completion_tokens if served else None,
        r.http_status, r.request_id, r.status, r.route or None, r.slice or None, r.pool or None, r.rule or None,
        r.reason or None, r.proposer if decided else None, r.draft_tokens if decided else None,
        t.explored if decided else None, r.exploration, r.fallback if decided else None, r.retries,
        r.worker or None, r.verify_ct, r.accept_length, r.num_proposed_drafts, r.num_correct_drafts,
        _ms(r.ttft_s), _ms(r.tpot_s), _ms(r.overhead_s), _ms(r.slo_ttft_s), _ms(r.slo_tpot_s), r.slo_met,
        (r.error_type or r.status) if failed else None]
    name = f"{t.operation} {t.model}" if t.model else t.operation
    spans.append(WireSpan(name, t.root_id, 0, SERVER, t.start_ns, t.end_ns, attributes,
                          (r.error_message or r.status) if failed else None))
    return WireTrace(t.trace_hi, t.trace_lo, t.remote_parent, t.remote_flags, t.trace_state, spans)


def _ms(seconds: float | None) -> float | None:
    return seconds * 1e3 if seconds is not None else None
