"""Compose files: valid against the Compose Specification schema, and wired to the policies they run."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest

from deploy_files import COMPOSE, DEPLOY, POLICIES, compose_services, load_yaml

SCHEMA = json.loads((Path(__file__).parent / "fixtures" / "compose-spec.json").read_text(encoding="utf-8"))
VALIDATOR = jsonschema.Draft201909Validator(SCHEMA)


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_compose_file_is_valid_against_the_compose_spec(name):
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in VALIDATOR.iter_errors(load_yaml(COMPOSE / f"{name}.yaml"))]
    assert errors == []


def test_the_schema_rejects_an_unknown_service_key():
    compose = copy.deepcopy(load_yaml(COMPOSE / "gpu.yaml"))
    compose["services"]["gateway"]["enviroment"] = {}
    assert [e.message for e in VALIDATOR.iter_errors(compose)] != []


def _host_sources(name):
    """Bind-mount sources of a compose file, resolved like compose does (relative to the file)."""
    for spec in compose_services(name).values():
        for volume in spec.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                yield (COMPOSE / source).resolve()


def test_cpu_compose_runs_default_policy_against_its_embedded_worker():
    services = compose_services("cpu")
    worker, gateway = services["worker"], services["gateway"]
    assert gateway["network_mode"] == "service:worker"
    policy = load_yaml(POLICIES / "default.yaml")
    urls = {url for pool in policy["pools"].values() for url in pool["workers"]}
    worker_port = worker["command"][worker["command"].index("--port") + 1]
    worker_host = worker["command"][worker["command"].index("--host") + 1]
    # Every worker URL default.yaml names is the embedded worker, reachable in the shared namespace.
    assert {(urlsplit(u).hostname, str(urlsplit(u).port)) for u in urls} == {(worker_host, worker_port)}
    assert worker["command"][0] == "worker"
    assert gateway["command"][:3] == ["serve", "--policy", "/etc/specgate/policy/default.yaml"]
    assert "../policies:/etc/specgate/policy:ro" in gateway["volumes"]
    assert all(p.exists() for p in _host_sources("cpu"))
    assert worker["ports"] == ["127.0.0.1:8000:8000"]


def test_gpu_compose_gateway_has_every_route_key_and_prometheus_scrapes_every_server():
    services = compose_services("gpu")
    gateway = services["gateway"]
    policy_path = gateway["command"][gateway["command"].index("--policy") + 1]
    assert policy_path == "/etc/specgate/policy/gpu-compose.yaml"
    policy = load_yaml(POLICIES / "gpu-compose.yaml")
    needed = {r["api_keys_env"] for r in policy["routes"]} | {"SPECGATE_ADMIN_TOKEN"}
    assert set(gateway["environment"]) == needed | {"OTEL_EXPORTER_OTLP_ENDPOINT", "SPECGATE_STATE_PASSWORD"}
    example = {line.split("=")[0] for line in (COMPOSE / "example.env").read_text().splitlines()
               if line and not line.startswith("#")}
    assert needed | {"SPECGATE_STATE_PASSWORD"} <= example
    # the fleet state: the gateway's --state names the compose valkey service, which requires the same password
    assert gateway["command"][gateway["command"].index("--state") + 1] == "valkey://valkey:6379/0"
    assert services["valkey"]["image"].startswith("valkey/valkey:") and "valkey" in gateway["depends_on"]
    assert services["valkey"]["environment"]["VALKEY_PASSWORD"].startswith("${SPECGATE_STATE_PASSWORD")
    assert "ports" not in services["valkey"]
    prometheus = load_yaml(DEPLOY / "prometheus" / "compose.yml")
    targets = {t for job in prometheus["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    sglang = {svc for svc, spec in services.items() if spec.get("image", "").startswith("lmsysorg/sglang:")}
    assert targets == {"gateway:8000"} | {f"{svc}:30000" for svc in sglang}
    mounts = {v.split(":")[1]: (COMPOSE / v.split(":")[0]).resolve() for v in services["prometheus"]["volumes"]
              if v.startswith(".")}
    assert mounts["/etc/prometheus/prometheus.yml"] == DEPLOY / "prometheus" / "compose.yml"
    # every rule file the config loads is mounted there, read-only, from deploy/prometheus, and holds rule groups
    assert prometheus["rule_files"] == ["/etc/prometheus/alerts.yml"]
    assert mounts["/etc/prometheus/alerts.yml"] == DEPLOY / "prometheus" / "alerts.yml"
    assert "../prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in services["prometheus"]["volumes"]
    assert [g["name"] for g in load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"]] == ["specgate-pair-gates"]
    devices = [services[s]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in sorted(sglang)]
    assert sorted(d for ids in devices for d in ids) == ["0", "1"], "each server gets its own GPU"


def test_every_host_path_the_gpu_compose_mounts_exists():
    missing = [str(p.relative_to(DEPLOY)) for p in _host_sources("gpu") if not p.exists()]
    assert missing == []


@pytest.mark.parametrize(("name", "exporters"), [("cpu", ("worker", "gateway")), ("gpu", ("gateway",))])
def test_traces_go_to_the_compose_collector_which_receives_otlp_http(name, exporters):
    services = compose_services(name)
    collector = services["otel-collector"]
    assert collector["image"] == "otel/opentelemetry-collector:0.138.0"
    assert collector["volumes"] == ["../otel/collector.yaml:/etc/otelcol/config.yaml:ro"]
    assert collector["command"] == ["--config=/etc/otelcol/config.yaml"]
    for service in exporters:
        assert services[service]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
    config = load_yaml(DEPLOY / "otel" / "collector.yaml")
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"] == "0.0.0.0:4318"
    assert config["service"]["pipelines"]["traces"] == {"receivers": ["otlp"], "processors": ["batch"],
                                                        "exporters": ["debug"]}
