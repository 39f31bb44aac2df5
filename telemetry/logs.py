"""Structured logs: JSON lines in production, readable console lines in development.

One line per request (event ``request``) with what an operator greps for: request id, route, slice,
decision (rule, pool, proposer, k), status, token counts, TTFT, TPOT and accept length; failures carry
``error`` (the type) and ``cause`` (the message). One line per pair gate event (event ``pair_gate``: pool,
key, gate, state, previous, reason), a warning when the pool is failed or degraded after it. Prompt and completion text never reach a log line
unless ``Telemetry(debug_text=True)``; anything shaped like an API key or bearer token is masked in
every line, whatever logged it, because a leaked key in a log aggregator is a credential leak.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import msgspec
import structlog

from telemetry.record import RequestRecord
from telemetry.views import GateEventView

TEXT_FIELDS = ("prompt_text", "completion_text", "prompt", "completion", "messages")
# OpenAI-style keys (sk-..., sk-proj-...), "Bearer <token>", and "api_key=<value>" / "token: <value>"
_SECRET = re.compile(r"(?i)\bbearer\s+\S+|\bsk-[A-Za-z0-9_\-]{8,}"
                     r"|\b(?:api[_-]?key|x-api-key|token|authorization|password|secret)\b[\"']?\s*[=:]\s*[\"']?[^\s\"',;]+")
MASK = "[redacted]"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
           "critical": logging.CRITICAL}


def mask_secrets(text: str) -> str:
    return _SECRET.sub(MASK, text)


def _redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Drop text fields unless the caller marked the line ``debug_text``; mask key-like strings."""
    if not event.pop("debug_text", False):
        for name in TEXT_FIELDS:
            event.pop(name, None)
    for name, value in event.items():
        if isinstance(value, str):
            event[name] = mask_secrets(value)
    return event


def configure_logging(json: bool, level: str = "info", *, stream: TextIO | None = None) -> None:
    """Configure structlog process-wide. ``json``: one JSON object per line (production); otherwise
    coloured key=value console lines (development). ``stream`` defaults to stdout (tests pass a buffer)."""
    if level.lower() not in _LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(_LEVELS)}; fix --log-level")
    renderer: Any = (structlog.processors.JSONRenderer() if json
                     else structlog.dev.ConsoleRenderer(colors=stream is None and sys.stdout.isatty()))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _redact,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level.lower()]),
        logger_factory=structlog.PrintLoggerFactory(file=stream) if stream is not None
        else structlog.PrintLoggerFactory(),
        cache_logger_on_first_use=False,
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def request_fields(record: RequestRecord, *, debug_text: bool) -> dict[str, Any]:
    """The per-request line's fields (text only when ``debug_text``)."""
    fields: dict[str, Any] = {
        "request_id": record.request_id, "route": record.route, "slice": record.slice, "rule": record.rule,
        "pool": record.pool, "proposer": record.proposer, "k": record.draft_tokens, "reason": record.reason,
        "explored": record.explored,
        "exploration": record.exploration, "fallback": record.fallback, "endpoint": record.endpoint,
        "stream": record.stream,
        "status": record.status, "http_status": record.http_status,
        "prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens,
        "ttft_ms": _ms(record.ttft_s), "tpot_ms": _ms(record.tpot_s),
        "tpot_source": record.tpot_source, "e2e_ms": _ms(record.e2e_s), "concurrency": record.concurrency,
        "overhead_ms": _ms(record.overhead_s), "accept_length": record.accept_length,
        "verify_ct": record.verify_ct, "slo_met": record.slo_met, "retries": record.retries,
        "worker": record.worker,
    }
    if record.resumes:  # count, at which token, from which worker to which
        fields["resumed"] = {"count": sum(1 for r in record.resumes if r.outcome == "ok"),
                             "steps": [msgspec.to_builtins(r) for r in record.resumes]}
    if record.status != "ok":
        fields["error"] = record.error_type
        fields["cause"] = record.error_message
    if debug_text:
        fields["debug_text"] = True
        fields["prompt_text"] = record.prompt_text
        fields["completion_text"] = record.completion_text
    return fields


def log_request(logger: Any, record: RequestRecord, *, debug_text: bool) -> None:
    """Info for ok, warning for client-side outcomes, error for upstream/unavailable failures. The fields
    are built only when the level is enabled: at ``--log-level warning`` an ok request costs no dict."""
    if record.status in ("upstream_error", "unavailable"):
        name, level = "error", logging.ERROR
    elif record.status != "ok":
        name, level = "warning", logging.WARNING
    else:
        name, level = "info", logging.INFO
    bound = logger.bind()  # a lazy proxy (structlog.get_logger) binds on every use: once here, not twice
    enabled = getattr(bound, "is_enabled_for", None)
    if enabled is not None and not enabled(level):
        return
    getattr(bound, name)("request", **request_fields(record, debug_text=debug_text))


def log_gate_event(logger: Any, event: GateEventView) -> None:
    """A pair gate event: warning when it leaves the pool failed or degraded (held out, or its acceptance
    collapsed), info otherwise."""
    level = "warning" if event.state in ("failed", "degraded") else "info"
    getattr(logger, level)("pair_gate", pool=event.pool, key=event.key, gate=event.gate, state=event.state,
                           previous=event.previous, reason=event.reason)
