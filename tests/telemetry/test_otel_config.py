"""When trace export is on (telemetry/otel.py): only with an OTLP endpoint in the standard environment variables,
and never with the SDK disabled; off, nothing of OpenTelemetry is even imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

from telemetry import otel

ON = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}


@pytest.mark.parametrize(("env", "on"), [
    ({}, False),
    (ON, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": " "}, False),
    ({**ON, "OTEL_SDK_DISABLED": "true"}, False),
    ({**ON, "OTEL_SDK_DISABLED": "TRUE"}, False),
    ({**ON, "OTEL_SDK_DISABLED": "false"}, True),
    ({**ON, "OTEL_TRACES_EXPORTER": "none"}, False),
    ({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, False),
])
def test_on_only_with_an_endpoint_and_the_sdk_enabled(env, on):
    assert otel.enabled(env) is on


def _gateway_prints(tmp_path, expression: str, env: dict[str, str] | None = None) -> str:
    """Build a ``GatewayState`` in a fresh Python process (only ``env`` set) and print ``expression`` of ``s``, the
    state (a fresh process: imports are process-wide)."""
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nslices: [{name: s}]\npools: {plain: {proposer: none, workers: "
                      '["http://127.0.0.1:9"]}}\n')
    code = ("import sys; from gateway.settings import GatewaySettings; from gateway.state import GatewayState; "
            f"s = GatewayState(GatewaySettings(policy_path={str(policy)!r})); print({expression}); "
            "s.otel and s.otel.shutdown()")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ".", **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()


def test_off_the_gateway_builds_no_tracer_and_imports_no_opentelemetry(tmp_path):
    expression = "s.otel, sorted(m for m in sys.modules if m.startswith('opentelemetry'))"
    assert _gateway_prints(tmp_path, expression) == "None []"


def test_on_the_service_name_and_the_sampler_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")  # the SDK reads the process's environment
    export = otel.configure("specgate-worker", {**ON, "OTEL_SERVICE_NAME": "edge-gw"})
    assert export is not None
    assert (export.service, export.pipe.service, export.pipe.env["OTEL_EXPORTER_OTLP_ENDPOINT"]) == \
        ("edge-gw", "edge-gw", ON["OTEL_EXPORTER_OTLP_ENDPOINT"])  # the exporter process gets the same settings
    assert export.decide(None, "chat")[1] is False  # OTEL_TRACES_SAMPLER, read by the SDK
    monkeypatch.delenv("OTEL_TRACES_SAMPLER")
    export = otel.configure("specgate-worker", ON)
    assert export is not None and export.service == "specgate-worker" and export.decide(None, "chat")[1] is True


def test_on_the_gateway_exports_from_a_process_of_its_own(tmp_path):
    """On, the gateway's process has no exporter, batch processor or export thread (they would take the GIL from
    its requests): its exporter process, started with the gateway, has them (telemetry/otel_pipe.py)."""
    expression = ("s.otel.start(), s.otel.service, s.otel.pipe.process.args[1:], __import__('threading').active_count(), "
                  "sorted(m for m in sys.modules if m.startswith(('opentelemetry.exporter', 'opentelemetry.sdk.trace.export')))")
    assert _gateway_prints(tmp_path, expression, {**ON, "OTEL_SERVICE_NAME": "edge-gw"}) == \
        "None edge-gw ['-m', 'telemetry.otel_export', 'edge-gw'] 1 []"


def test_spans_the_gateway_drops_are_counted_in_its_metrics(tmp_path):
    """A sampled request's spans with no exporter process to take them (never started here) are dropped, and
    ``specgate_otel_dropped_traces_total`` says so, by reason."""
    expression = ("s.otel.pipe.ship(__import__('telemetry.otel_pipe', fromlist=['_']).WireTrace(0, 1, 0, 0, '', [])), "
                  "s.otel.pipe.flush(), [line for line in s.telemetry.metrics_response()[0].decode().splitlines() "
                  "if line.startswith('specgate_otel_dropped_traces_total')]")
    out = _gateway_prints(tmp_path, expression, ON)
    assert out.endswith("""None None ['specgate_otel_dropped_traces_total{reason="exporter_gone"} 1.0']""")
