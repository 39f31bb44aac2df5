"""Telemetry of the gateway: Prometheus metrics, structured logs and the built-in dashboard.

``Telemetry`` (core.py) is the one entry point; ``telemetry.logs.configure_logging`` sets up logging
and ``telemetry.dashboard.router`` serves ``/dashboard``.
"""

from __future__ import annotations

from telemetry.core import Telemetry
from telemetry.record import RequestRecord

__all__ = ["RequestRecord", "Telemetry"]
