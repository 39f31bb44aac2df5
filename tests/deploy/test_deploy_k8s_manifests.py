"""Kubernetes manifests: schema-valid offline, and shaped the way the gateway and SGLang need them."""

from __future__ import annotations

import copy
import os
import re

import kubernetes_validate
import pytest

from deploy_files import (
    DEPLOY, K8S_VERSION, LAUNCH, REPO, find, k8s_objects, k8s_pool_commands, kustomize, load_docs,
    manifest_files, parse_launch_args,
)
from tests.prerequisites import missing

SHA = re.compile(r"^[0-9a-f]{40}$")
# pool -> the --speculative-algorithm its Deployment must run (None: plain decoding).
EXPECTED_POOLS = {"plain": None, "eagle3": "EAGLE3", "ngram": "NGRAM", "standalone": "STANDALONE"}


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_is_valid_against_the_kubernetes_schema(path):
    docs = load_docs(path)
    assert docs, f"{path} holds no resource"
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_rejects_a_misspelled_field():
    deployment = copy.deepcopy(find(k8s_objects(), "Deployment", "specgate-gateway"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def _render(directory):
    rendered = kustomize(directory)
    if rendered is None:
        missing("kubectl is not installed: cannot render the kustomization (apt-get install kubectl)")
    return rendered


def test_the_kustomization_renders_schema_valid_objects_with_policy_and_dashboard():
    rendered = _render(DEPLOY)
    for obj in rendered:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "specgate", obj["metadata"]["name"]
    policy = find(rendered, "ConfigMap", "specgate-policy")
    assert policy["data"] == {"policy.yaml": (DEPLOY / "policies" / "gpu.yaml").read_text(encoding="utf-8")}
    dashboard = find(rendered, "ConfigMap", "specgate-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"] == {"specgate.json": (DEPLOY / "grafana" / "specgate.json").read_text(encoding="utf-8")}
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in rendered
                   if o["kind"] in ("Deployment", "Service", "StatefulSet"))
    assert kinds == sorted([(k, n) for k in ("Deployment", "Service")
                            for n in ["specgate-gateway", *(f"sglang-{p}" for p in EXPECTED_POOLS)]]
                           + [("StatefulSet", "valkey"), ("Service", "valkey")])


def test_the_gateway_replicas_share_one_valkey_for_fleet_state():
    objects = k8s_objects()
    (container,) = find(objects, "Deployment", "specgate-gateway")["spec"]["template"]["spec"]["containers"]
    url = container["args"][container["args"].index("--state") + 1]
    service = find(objects, "Service", "valkey")
    assert url == f"valkey://valkey:{service['spec']['ports'][0]['port']}/0"
    (password,) = [e for e in container["env"] if e["name"] == "SPECGATE_STATE_PASSWORD"]
    (store,) = find(objects, "StatefulSet", "valkey")["spec"]["template"]["spec"]["containers"]
    (required,) = [e for e in store["env"] if e["name"] == "VALKEY_PASSWORD"]
    assert password["valueFrom"] == required["valueFrom"]  # the same Secret key on both sides
    assert "--requirepass" in " ".join(store["args"]) and store["image"].startswith("valkey/valkey:")


def test_an_overlay_outside_the_repository_can_retarget_namespace_and_image(tmp_path):
    overlay = tmp_path / "staging"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "namespace: specgate-staging\n"
        f"resources: [{os.path.relpath(DEPLOY, overlay)}]\n"  # kustomize rejects absolute roots
        "images:\n  - {name: specgate, newName: registry.example.com/specgate, newTag: 0.1.0}\n")
    rendered = _render(overlay)
    assert {o["metadata"].get("namespace") for o in rendered if o["kind"] != "Namespace"} == {"specgate-staging"}
    gateway = find(rendered, "Deployment", "specgate-gateway")
    assert gateway["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example.com/specgate:0.1.0"


def test_the_gateway_deployment_probes_mounts_the_policy_and_reads_secrets():
    objects = k8s_objects()
    deployment = find(objects, "Deployment", "specgate-gateway")
    assert deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}
    # The ConfigMap is mounted as a directory: a subPath mount never sees the kubelet's update.
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "policy"]
    assert "subPath" not in mount
    policy_arg = container["args"][container["args"].index("--policy") + 1]
    assert policy_arg == f"{mount['mountPath']}/policy.yaml"
    (volume,) = [v for v in pod["volumes"] if v["name"] == "policy"]
    assert volume["configMap"]["name"] == "specgate-policy"
    kustomization = load_docs(DEPLOY / "kustomization.yaml")[0]
    generated = {g["name"]: g for g in kustomization["configMapGenerator"]}
    assert generated["specgate-policy"]["files"] == ["policy.yaml=policies/gpu.yaml"]
    assert generated["specgate-policy"]["options"]["disableNameSuffixHash"] is True
    assert [e["secretRef"]["name"] for e in container["envFrom"]] == ["specgate-api-keys", "specgate-admin"]
    service = find(objects, "Service", "specgate-gateway")
    assert service["spec"]["selector"].items() <= pod_labels(deployment).items()
    pdb = find(objects, "PodDisruptionBudget", "specgate-gateway")
    assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]


def pod_labels(deployment):
    return deployment["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("pool", sorted(EXPECTED_POOLS))
def test_each_pool_is_one_gpu_deployment_with_a_service_and_scrape_annotations(pool):
    objects = k8s_objects()
    deployment = find(objects, "Deployment", f"sglang-{pool}")
    template = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"name": "http", "containerPort": 30000, "protocol": "TCP"} in container["ports"]
    annotations = template["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "30000", "prometheus.io/path": "/metrics"}
    service = find(objects, "Service", f"sglang-{pool}")
    assert service["spec"]["selector"].items() <= pod_labels(deployment).items()
    assert service["spec"]["ports"] == [{"name": "http", "port": 30000, "targetPort": "http", "protocol": "TCP"}]


def test_there_is_exactly_one_pool_per_speculative_configuration_and_revisions_are_pinned():
    commands = k8s_pool_commands()
    assert sorted(commands) == sorted(EXPECTED_POOLS)
    for pool, argv in commands.items():
        assert argv[:3] == LAUNCH, pool
        flags = parse_launch_args(argv[3:])
        assert flags.get("--speculative-algorithm") == EXPECTED_POOLS[pool], pool
        assert "--enable-metrics" in flags and flags["--host"] == "0.0.0.0" and flags["--port"] == "30000", pool
        assert SHA.match(flags["--revision"]), f"{pool}: --revision must be a commit sha"
        if "--speculative-draft-model-path" in flags:
            assert SHA.match(flags["--speculative-draft-model-revision"]), f"{pool}: draft revision must be a sha"
        assert "--speculative-num-draft-tokens" in flags or EXPECTED_POOLS[pool] is None, pool


def test_docs_create_every_secret_the_manifests_reference():
    doc = (REPO / "docs" / "deploy.md").read_text(encoding="utf-8")
    referenced = set()
    for obj in k8s_objects():
        for container in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            referenced |= {e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e}
            referenced |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
                           if "secretKeyRef" in e.get("valueFrom", {})}
    assert referenced == {"specgate-api-keys", "specgate-admin", "hf-token", "specgate-valkey"}
    for name in sorted(referenced):
        assert f"kubectl -n specgate create secret generic {name}" in doc, name
