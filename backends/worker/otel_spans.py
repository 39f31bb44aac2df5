"""The worker's OpenTelemetry span per request, continuing the caller's trace (set-up and recording:
``telemetry/otel.py``; exported by the worker's exporter process, ``telemetry/otel_pipe.py``).

Built only when trace export is configured (``WorkerRuntime.otel`` is not None). The request's ``traceparent``
(the gateway's dispatch attempt) is the parent:

    "chat MODEL" (SERVER): submit to the finished event; gen_ai.* and the request's totals
      ├─ queue     waiting for a running slot (RequestStats.queue_s)
      ├─ prefill   the prompt's forwards, to the first committed token; ``specgate.prefill_chunks``
      └─ decode    first committed token to the end: rounds, drafts proposed/accepted, draft/verify seconds

Phases are spans with the engine's own measured times; rounds are counted, never one span each (a span per
round would cost more than an n-gram round itself).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from telemetry import otel
from telemetry.otel_pipe import SERVER

if TYPE_CHECKING:
    from backends.engine.types import GenerateRequest, RequestOutput
    from telemetry.otel import TraceExport

_NS = 1_000_000_000


class WorkerSpan:
    __slots__ = ("_rec", "_t0", "_name", "_attributes", "recording")

    def __init__(self, export: TraceExport, headers: Any, endpoint: str, model: str, req: GenerateRequest) -> None:
        self._t0 = time.time_ns()  # just before the engine's submit: the engine's times count from there
        op = otel.operation(endpoint) if endpoint != "generate" else "generate"
        client, trace_id, unsampled = otel.arrived(export, headers, op)
        self.recording = unsampled is None  # not sampled: nothing more is recorded
        self._rec = otel.Recording(export, client, trace_id) if self.recording else None
        self._name = f"{op} {model}"
        self._attributes = otel.attributes({
            "gen_ai.operation.name": op, "gen_ai.provider.name": "specgate", "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": req.sampling.max_new_tokens,
            "gen_ai.request.temperature": req.sampling.temperature,
            "gen_ai.usage.input_tokens": len(req.input_ids), "specgate.worker_rid": req.rid,
            "specgate.proposer": req.speculation.proposer,
            "specgate.draft_tokens": req.speculation.draft_tokens if req.speculation.proposer != "none" else 0,
            "specgate.adaptive": req.speculation.adaptive}) if self.recording else {}

    def _phase(self, name: str, start_s: float, end_s: float, attributes: dict[str, Any] | None = None) -> None:
        self._rec.child(name, self._t0 + int(start_s * _NS), self._t0 + int(max(start_s, end_s) * _NS), attributes)

    def _ship(self, end_ns: int, error_type: str | None = None, message: str = "") -> None:
        if error_type is not None:
            self._attributes["error.type"] = error_type  # as the semantic conventions name it
        self._rec.ship(self._name, SERVER, self._t0, end_ns, self._attributes,
                       (message or error_type) if error_type is not None else None)

    def finish(self, out: RequestOutput) -> None:
        if not self.recording:
            return
        s = out.stats
        end_s = s.e2e_s if s.e2e_s is not None else (time.time_ns() - self._t0) / _NS
        first = s.first_token_s
        rounds = {"specgate.rounds": s.verify_ct, "specgate.draft_tokens_proposed": s.num_proposed_drafts,
                  "specgate.draft_tokens_accepted": s.num_correct_drafts,
                  "specgate.accept_length": round(s.accept_length, 6), "specgate.draft_s": round(s.draft_s, 6),
                  "specgate.verify_s": round(s.verify_s, 6), "specgate.overhead_s": round(s.overhead_s, 6),
                  "specgate.neighbour_s": round(s.neighbour_s, 6)}
        self._phase("queue", 0.0, s.queue_s)
        self._phase("prefill", s.queue_s, first if first is not None else end_s,
                    {"specgate.prefill_chunks": s.prefill_chunks, "gen_ai.usage.input_tokens": s.prompt_tokens})
        if first is not None:
            self._phase("decode", first, end_s, {**rounds, "gen_ai.usage.output_tokens": len(out.output_ids)})
        reason = out.finish_reason
        self._attributes.update(otel.attributes({
            **rounds, "gen_ai.usage.output_tokens": len(out.output_ids), "specgate.queue_s": round(s.queue_s, 6),
            "specgate.prefill_chunks": s.prefill_chunks,
            "specgate.first_token_s": round(first, 6) if first is not None else None,
            "gen_ai.response.finish_reasons": [reason.type] if reason is not None else None}))
        end_ns = self._t0 + int(end_s * _NS)
        if reason is not None and reason.type == "abort":
            self._ship(end_ns, "abort", reason.message or "aborted")
        else:
            self._ship(end_ns)

    def refused(self, exc: Exception) -> None:
        """The engine refused the request at submission (queue full, can never fit)."""
        if self.recording:
            self._ship(time.time_ns(), type(exc).__name__, str(exc))

    def abandon(self) -> None:
        """The caller left before the end (the engine request is aborted by the bridge)."""
        if self.recording:
            self._ship(time.time_ns(), "ClientDisconnected", "the caller left before the end")


async def traced(events: AsyncIterator[RequestOutput], span: WorkerSpan) -> AsyncIterator[RequestOutput]:
    """``events`` unchanged; the span ends with the finished event (or when the consumer leaves)."""
    finished = False
    try:
        async for out in events:
            if out.finished:
                finished = True
                span.finish(out)
            yield out
    finally:
        if not finished:
            span.abandon()
        await events.aclose()  # type: ignore[attr-defined]
