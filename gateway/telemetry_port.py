"""The gateway's one door to ``telemetry``: ``make_telemetry`` returns ``telemetry.Telemetry`` when
that package provides it, else ``PendingTelemetry`` (logs each record; empty metrics), so the gateway
runs before telemetry lands. The contract both follow is the list of methods below."""

from __future__ import annotations

from typing import Any

import structlog

from telemetry.record import RequestRecord


class PendingTelemetry:
    """Stand-in with the ``telemetry.Telemetry`` interface; exposes no metrics."""

    def __init__(self, policy: Any, *, debug_text: bool = False) -> None:
        self.logger = structlog.get_logger("specgate")

    def observe(self, record: RequestRecord) -> None:
        self.logger.info("request", request_id=record.request_id, route=record.route,
                         slice=record.slice, pool=record.pool, rule=record.rule,
                         status=record.status, http_status=record.http_status)

    def set_pools(self, snapshots: dict[str, Any], workers: dict[str, list[Any]] | None = None) -> None:
        pass

    def set_policy(self, policy: Any, *, version: str, reload_ok: bool, error: str | None) -> None:
        pass

    def observe_overhead(self, seconds: float) -> None:
        pass

    def metrics_response(self) -> tuple[bytes, str]:
        return b"# telemetry package not installed: no metrics\n", "text/plain; version=0.0.4"


def make_telemetry(policy: Any, *, debug_text: bool) -> Any:
    try:
        from telemetry import Telemetry  # type: ignore[attr-defined]
    except ImportError:
        return PendingTelemetry(policy, debug_text=debug_text)
    return Telemetry(policy, debug_text=debug_text)


def dashboard_router(telemetry: Any) -> Any | None:
    """``telemetry.dashboard.router(telemetry)`` when available."""
    try:
        from telemetry.dashboard import router  # type: ignore[import-not-found]
    except ImportError:
        return None
    return router(telemetry)
