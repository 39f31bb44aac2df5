"""The policies pass `specgate policy check` and name exactly the pools, URLs and pair versions deployed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy_files import (
    POLICIES, compose_sglang_commands, find, k8s_objects, k8s_pool_commands, load_yaml, parse_launch_args,
    sglang_algorithm, worker_flags,
)
from cli import build_parser
from policies.load import load_policy

SPECGATE = Path(sys.executable).parent / "specgate"
PROPOSER_OF = {None: "none", "EAGLE3": "eagle3", "NGRAM": "ngram", "STANDALONE": "standalone"}


@pytest.mark.parametrize("name", ["gpu.yaml", "gpu-compose.yaml", "default.yaml"])
def test_policy_check_accepts_the_shipped_policy(name):
    done = subprocess.run([str(SPECGATE), "policy", "check", str(POLICIES / name)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_policy_check_rejects_a_policy_naming_an_undeployed_pool(tmp_path):
    broken = tmp_path / "gpu.yaml"
    broken.write_text((POLICIES / "gpu.yaml").read_text().replace("then: {pools: [ngram, eagle3]}",
                                                                  "then: {pools: [ngram, eagle4]}"))
    done = subprocess.run([str(SPECGATE), "policy", "check", str(broken)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "eagle4" in done.stdout + done.stderr


def assert_policy_matches_servers(policy: dict, servers: dict[str, list[str]]) -> None:
    """Each pool's single worker runs the command in ``servers[pool]`` and the pool's pair is exactly what
    those flags pin: target model/revision/weight version, draft model/revision, algorithm settings. A pool
    whose proposer SGLang does not have (suffix) is refused first, naming the pool and the fix."""
    for name, pool in policy["pools"].items():
        sglang_algorithm(name, pool)
    assert sorted(policy["pools"]) == sorted(servers)
    for name, pool in policy["pools"].items():
        flags = parse_launch_args(servers[name][3:])
        algorithm = flags.get("--speculative-algorithm")
        assert algorithm == sglang_algorithm(name, pool), name
        assert pool["proposer"] == PROPOSER_OF[algorithm], name
        assert pool.get("speculation", "server") == "server", name
        if algorithm is None:
            assert "pair" not in pool and "draft_tokens" not in pool, name
            continue
        num_draft_tokens = int(flags["--speculative-num-draft-tokens"])
        assert pool["draft_tokens"] == num_draft_tokens - 1, name
        pair = policy["pairs"][pool["pair"]]
        assert pair["target"] == {"model": flags["--model-path"], "revision": flags["--revision"],
                                  "weight_version": flags["--weight-version"]}, name
        draft = pair["draft"]
        assert draft.get("model") == flags.get("--speculative-draft-model-path"), name
        assert draft.get("revision") == flags.get("--speculative-draft-model-revision"), name
        settings = {"num_steps": "--speculative-num-steps", "eagle_topk": "--speculative-eagle-topk",
                    "num_draft_tokens": "--speculative-num-draft-tokens"}
        assert draft["params"] == {key: int(flags[flag]) for key, flag in settings.items() if flag in flags}, name


def test_gpu_policy_names_exactly_the_kubernetes_pools_services_and_pair_versions():
    policy = load_yaml(POLICIES / "gpu.yaml")
    objects = k8s_objects()
    for name, pool in policy["pools"].items():
        service = find(objects, "Service", f"sglang-{name}")
        assert pool["workers"] == [f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"]
    assert_policy_matches_servers(policy, k8s_pool_commands())


def test_gpu_compose_policy_names_exactly_the_compose_servers_and_shares_gpu_policy_pairs():
    policy = load_yaml(POLICIES / "gpu-compose.yaml")
    servers = compose_sglang_commands()
    for name, pool in policy["pools"].items():
        assert pool["workers"] == [f"http://sglang-{name}:30000"]
    assert_policy_matches_servers(policy, {svc.removeprefix("sglang-"): argv for svc, argv in servers.items()})
    gpu = load_yaml(POLICIES / "gpu.yaml")
    assert {k: gpu["pairs"][k] for k in policy["pairs"]} == policy["pairs"]
    assert policy["routes"] == gpu["routes"] and policy["slices"] == gpu["slices"]


def test_a_suffix_pool_launched_as_sglang_servers_is_refused_naming_the_pool_and_the_fix():
    """The policy itself is valid (a suffix pool is fine on specgate's workers); deploying it on the kit's
    SGLang Deployments is not."""
    policy = load_yaml(POLICIES / "gpu.yaml")
    policy["pools"]["ngram"]["proposer"] = "suffix"
    policy["pairs"][policy["pools"]["ngram"]["pair"]]["draft"] = {"kind": "suffix"}
    load_policy(yaml.safe_dump(policy), "gpu.yaml")
    with pytest.raises(AssertionError) as exc:
        assert_policy_matches_servers(policy, k8s_pool_commands())
    assert str(exc.value) == (
        "pool 'ngram': proposer suffix cannot run on SGLang servers: SGLang has no suffix decoding (no "
        "--speculative-algorithm SUFFIX). Serve the pool with specgate's embedded worker (`specgate worker "
        "--speculative-algorithm SUFFIX --speculative-num-draft-tokens 7`, or speculation: per_request), or run "
        "vLLM's `suffix` method (--speculative-config '{\"method\": \"suffix\"}') outside specgate's pools")


def documented_worker_commands(path: Path) -> dict[str, list[str]]:
    """pool -> the `specgate worker ...` command line the policy's header comment gives for its workers."""
    commands = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        if match := re.fullmatch(r"#\s+([\w.-]+):\s+specgate (worker .*)", line):
            commands[match[1]] = match[2].split()
    return commands


def test_the_embedded_worker_example_launches_its_suffix_pool_with_the_suffix_algorithm():
    """deploy/policies/examples/cpu-suffix.yaml: each pool's documented `specgate worker` command parses with
    the real CLI, listens where the pool's URL says, and carries exactly the pool's speculation flags."""
    from backends.worker.settings import WorkerSettings

    path = POLICIES / "examples" / "cpu-suffix.yaml"
    policy = load_yaml(path)
    commands = documented_worker_commands(path)
    assert sorted(commands) == sorted(policy["pools"])
    for name, pool in policy["pools"].items():
        argv = commands[name]
        args = build_parser().parse_args(argv)
        assert pool["workers"] == [f"http://127.0.0.1:{args.port}"] and argv[1:3] == ["--port", str(args.port)]
        assert argv[3:] == worker_flags(name, pool), name
    suffix = policy["pools"]["suffix"]
    assert worker_flags("suffix", suffix) == ["--speculative-algorithm", "SUFFIX",
                                              "--speculative-num-draft-tokens", "8"]
    args = build_parser().parse_args(commands["suffix"])
    spec = WorkerSettings(speculative_algorithm=args.speculative_algorithm,
                          speculative_num_draft_tokens=args.speculative_num_draft_tokens).default_speculation
    assert (spec.proposer, spec.draft_tokens) == ("suffix", 8)
    with pytest.raises(AssertionError, match=r"^pool 'suffix': proposer suffix cannot run on SGLang servers"):
        sglang_algorithm("suffix", suffix)
