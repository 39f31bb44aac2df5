"""Reading the deployment kit the way the tools that consume it do: manifests, compose files, commands.

Shared by the tests in this folder. SGLang command lines are parsed against SGLang 0.5.23's real flag
list (`sglang_server_args.py`), so a misspelled or removed flag fails here, not on a GPU node.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from sglang_server_args import SWITCH_FLAGS, VALUE_FLAGS

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
POOLS_DIR = K8S / "base" / "pools"
COMPOSE = DEPLOY / "compose"
POLICIES = DEPLOY / "policies"
LAUNCH = ["python3", "-m", "sglang.launch_server"]
# A server-mode pool's proposer -> the --speculative-algorithm its servers run (None: plain decoding).
SGLANG_ALGORITHM: dict[str, str | None] = {"none": None, "ngram": "NGRAM", "draft_model": "STANDALONE",
                                           "standalone": "STANDALONE", "eagle": "EAGLE", "eagle3": "EAGLE3"}
WORKER_ALGORITHM: dict[str, str | None] = {"none": None, "ngram": "NGRAM", "draft_model": "STANDALONE",
                                           "suffix": "SUFFIX"}  # `specgate worker`, the embedded engine
K8S_VERSION = "1.37.0"


def load_docs(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document in a file."""
    with path.open(encoding="utf-8") as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc]


def load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def manifest_files() -> list[Path]:
    """Every Kubernetes resource file under deploy/k8s (kustomization files are not resources)."""
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def k8s_objects() -> list[dict[str, Any]]:
    return [doc for path in manifest_files() for doc in load_docs(path)]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected exactly one {kind} {name}, found {len(matches)}"
    return matches[0]


def kustomize(directory: Path) -> list[dict[str, Any]] | None:
    """`kubectl kustomize DIR` parsed, or None when kubectl is not installed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def parse_launch_args(argv: list[str]) -> dict[str, str | None]:
    """`--flag value` / `--switch` pairs of an SGLang command line; None marks a switch.

    Raises AssertionError naming the flag when it is not an SGLang 0.5.23 server flag, when a value flag
    has no value, or when a flag is given twice."""
    flags: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        flag = argv[i]
        assert flag.startswith("--"), f"expected a --flag at position {i}, got {flag!r} in {argv}"
        assert flag not in flags, f"{flag} given twice"
        if flag in SWITCH_FLAGS:
            flags[flag] = None
            i += 1
        elif flag in VALUE_FLAGS:
            assert i + 1 < len(argv) and not argv[i + 1].startswith("--"), f"{flag} needs a value"
            flags[flag] = argv[i + 1]
            i += 2
        else:
            raise AssertionError(f"{flag} is not a server flag of SGLang 0.5.23")
    return flags


def sglang_algorithm(name: str, pool: dict[str, Any]) -> str | None:
    """The --speculative-algorithm of the SGLang servers of policy pool ``name``. A suffix pool is refused with
    an AssertionError naming the pool and the fix: SGLang has no suffix decoding (vLLM and specgate's worker do)."""
    if pool["proposer"] == "suffix":
        raise AssertionError(
            f"pool '{name}': proposer suffix cannot run on SGLang servers: SGLang has no suffix decoding (no "
            f"--speculative-algorithm SUFFIX). Serve the pool with specgate's embedded worker (`specgate worker "
            f"--speculative-algorithm SUFFIX --speculative-num-draft-tokens {pool.get('draft_tokens', 'K')}`, or "
            f"speculation: per_request), or run vLLM's `suffix` method (--speculative-config "
            f"'{{\"method\": \"suffix\"}}') outside specgate's pools")
    return SGLANG_ALGORITHM[pool["proposer"]]


def worker_flags(name: str, pool: dict[str, Any]) -> list[str]:
    """The speculative flags of `specgate worker` for policy pool ``name``: a server-mode pool's speculation is
    fixed at launch, as on SGLang; a per-request pool's workers are told per request (no flags)."""
    if pool.get("speculation", "server") == "per_request" or pool["proposer"] == "none":
        return []
    algorithm = WORKER_ALGORITHM.get(pool["proposer"])
    if algorithm is None:
        raise AssertionError(f"pool '{name}': proposer {pool['proposer']} does not run on specgate's embedded "
                             f"worker (it runs {', '.join(p for p in WORKER_ALGORITHM if p != 'none')})")
    return ["--speculative-algorithm", algorithm, "--speculative-num-draft-tokens", str(pool["draft_tokens"])]


def k8s_pool_commands() -> dict[str, list[str]]:
    """pool name (label specgate.io/pool) -> full SGLang command line of its Deployment."""
    commands = {}
    for obj in k8s_objects():
        if obj["kind"] != "Deployment" or obj["metadata"]["labels"].get("app.kubernetes.io/name") != "sglang":
            continue
        (container,) = obj["spec"]["template"]["spec"]["containers"]
        commands[obj["metadata"]["labels"]["specgate.io/pool"]] = container["command"] + container["args"]
    return commands


def compose_services(name: str) -> dict[str, dict[str, Any]]:
    return load_yaml(COMPOSE / f"{name}.yaml")["services"]


def compose_sglang_commands() -> dict[str, list[str]]:
    """compose service name -> SGLang command line, for every service that runs SGLang."""
    return {svc: spec["command"] for svc, spec in compose_services("gpu").items()
            if spec.get("image", "").startswith("lmsysorg/sglang:")}
