"""Parse Prometheus text exposition into {(sample name, sorted labels): value} for exact assertions."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from telemetry import Telemetry

Key = tuple[str, tuple[tuple[str, str], ...]]


def samples(telemetry: Telemetry) -> dict[Key, float]:
    body, _ = telemetry.metrics_response()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples if not s.name.endswith("_created")}


def only(found: dict[Key, float], name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of one name, keyed by labels."""
    return {labels: value for (n, labels), value in found.items() if n == name}


def lab(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))
