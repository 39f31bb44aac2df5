"""The Grafana dashboard, the Prometheus scrape configs and the alert rules parse, and every metric they name
exists: ``specgate_*`` in the gateway's /metrics after one record of each kind and the scripted pair gates
(tests/telemetry/gate_script.py), ``sglang:*`` in the worker's (the embedded worker exports SGLang's names).
An alert's ``label="value"`` matchers must match a series the gateway exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from backends.engine.types import EngineLoad
from backends.worker.metrics import WorkerMetrics
from gateway.telemetry_views import gate_event_view, gate_views, policy_view
from policies.load import load_policy_file
from telemetry import Telemetry
from tests.telemetry.gate_script import script
from tests.telemetry.traffic import plain_record, pool_state, speculative_record

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "specgate.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
SELECTOR = re.compile(r"(?<![\w:])((?:specgate_|sglang:)[A-Za-z0-9_:]+)\{([^}]*)\}")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
DURATION = re.compile(r"(\d+(ms|s|m|h|d|w|y))+")  # Prometheus' duration syntax
METRIC = re.compile(r"(?<![\w:])((?:specgate_|sglang:)[A-Za-z0-9_:]+)")
POLICY = load_policy_file(Path(__file__).with_name("policy.yaml"))


def _exprs(node) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)] + \
            [e for k, v in node.items() if k not in ("expr", "definition") for e in _exprs(v)]
    if isinstance(node, list):
        return [e for item in node for e in _exprs(item)]
    return []


def _exposition() -> str:
    import random

    telemetry = Telemetry(policy_view(POLICY))
    rng = random.Random(3)
    telemetry.observe(speculative_record(rng, request_id="s", route="ide", slice_="code", pool="ngram",
                                         proposer="ngram", rule="code-ngram", k=4, at=0.0, slo_tpot_s=0.03))
    telemetry.observe(plain_record(rng, request_id="p", route="chat", slice_="prose", rule="learned", at=0.0,
                                   slo_tpot_s=0.05))
    telemetry.set_pools(pool_state(POLICY, rng))
    book, events = script(0.0, 0.0)
    telemetry.record_gate_events([gate_event_view(e) for e in events])
    telemetry.set_gates(gate_views(book, 40.0))
    worker = WorkerMetrics("m")
    worker.refresh(EngineLoad(num_running_reqs=1, num_waiting_reqs=0, num_used_tokens=10, max_total_num_tokens=100,
                              max_running_requests=4))
    worker.itl.labels("m").observe(0.02)  # histograms export samples once a request was observed
    worker.ttft.labels("m").observe(0.1)
    return telemetry.metrics_response()[0].decode() + worker.render().decode()


def _exported_names() -> set[str]:
    text = _exposition()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")} | \
        {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}


def test_dashboard_parses_and_every_metric_it_names_exists():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "specgate"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    exprs = _exprs(dashboard)
    named = {m for e in exprs for m in METRIC.findall(e)}
    assert named - _exported_names() == set()
    # what the issue asks the dashboard to show, by the metric it must query
    for needed in ("specgate_spec_accepted_tokens_total", "specgate_spec_draft_tokens_total", "specgate_slo_met_total",
                   "specgate_requests_total", "specgate_time_per_output_token_seconds_bucket",
                   "specgate_spec_position_reached_total", "specgate_explorations_total", "sglang:token_usage",
                   "specgate_pair_gate_state", "specgate_pair_gate_ramp_share", "specgate_pair_collapse_alerts_total"):
        assert needed in named, needed
    assert any("by (rule)" in e for e in exprs), "decisions by rule"
    # panel boxes do not overlap on the 24-column grid
    cells = set()
    for p in panels:
        g = p["gridPos"]
        box = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert g["x"] + g["w"] <= 24 and not box & cells, p["title"]
        cells |= box


def test_prometheus_configs_scrape_the_gateway_and_sglang_workers():
    compose = yaml.safe_load((ROOT / "deploy" / "prometheus" / "compose.yml").read_text())
    jobs = {job["job_name"]: job for job in compose["scrape_configs"]}
    assert jobs["specgate-gateway"]["metrics_path"] == "/metrics"
    assert jobs["specgate-gateway"]["static_configs"][0]["targets"] == ["gateway:8000"]
    assert {g["labels"]["pool"] for g in jobs["sglang"]["static_configs"]} == {"plain", "eagle3"}
    k8s = yaml.safe_load((ROOT / "deploy" / "prometheus" / "kubernetes.yml").read_text())
    (job,) = k8s["scrape_configs"]
    relabel = {(tuple(r.get("source_labels", [])), r.get("target_label")) for r in job["relabel_configs"]}
    assert (("__meta_kubernetes_pod_label_specgate_io_pool",), "pool") in relabel  # dashboards group sglang:* by pool
    # rule files: compose.yml names the path deploy/compose/gpu.yaml mounts alerts.yml at
    # (tests/deploy/test_deploy_compose.py); kubernetes.yml the file beside it
    assert compose["rule_files"] == ["/etc/prometheus/alerts.yml"]
    assert k8s["rule_files"] == ["alerts.yml"] and (ROOT / "deploy" / "prometheus" / "alerts.yml").is_file()


def _series() -> dict[str, list[dict[str, str]]]:
    """metric name -> the label sets of its exported series."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(_exposition()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample.labels)
    return out


def test_alert_rules_parse_and_select_series_the_gateway_exports():
    (group,) = yaml.safe_load(ALERTS.read_text())["groups"]
    assert group["name"] == "specgate-pair-gates"
    rules = {rule["alert"]: rule for rule in group["rules"]}
    assert {name: (rule["expr"], rule.get("for"), rule["labels"]["severity"]) for name, rule in rules.items()} == {
        "SpecgatePairGateFailed": ('specgate_pair_gate_state{specgate_pair_gate_state="failed"} == 1', "1m",
                                   "critical"),
        "SpecgatePairGateDegraded": ('specgate_pair_gate_state{specgate_pair_gate_state="degraded"} == 1', "5m",
                                     "warning"),
        "SpecgateAcceptanceCollapse": ("increase(specgate_pair_collapse_alerts_total[10m]) > 0", None, "warning")}
    for name, rule in rules.items():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, name
        assert rule.get("for") is None or DURATION.fullmatch(rule["for"]), name
        assert "{{ $labels.pool }}" in rule["annotations"]["summary"] and rule["annotations"]["description"], name
    series = _series()
    exprs = [rule["expr"] for rule in rules.values()]
    assert {m for e in exprs for m in METRIC.findall(e)} - set(series) == set()
    for expr in exprs:
        for metric, matchers in SELECTOR.findall(expr):
            for label, op, value in MATCHER.findall(matchers):
                assert op == "=" and any(labels.get(label) == value for labels in series[metric]), \
                    f"{expr}: no {metric} series has {label}={value!r}"
    # the state series the rules select exist for a pool in that state (gate_script: draft failed, ngram degraded)
    states = {(s["pool"], s["specgate_pair_gate_state"]) for s in series["specgate_pair_gate_state"]}
    assert {("draft", "failed"), ("ngram", "degraded")} <= states
