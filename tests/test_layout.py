"""Repository conventions that, when broken, fail in confusing ways elsewhere."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tokenize
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).parent


def test_test_module_basenames_are_unique():
    # test folders are not packages, so pytest imports test modules by basename: a duplicate name
    # aborts collection of the whole suite ("import file mismatch")
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []


def test_workload_data_lives_only_in_the_sample_with_its_licenses():
    # the repository carries one small sample of the public sets (workloads/README.md); nothing else copies them
    repo = TESTS.parent
    data = [p.relative_to(repo) for p in repo.rglob("*.jsonl") if not {".venv", ".bench-venv"} & set(p.parts)]
    assert [p for p in data if p.parts[0] != "workloads"] == []
    sets = {p.parts[1] for p in data}
    assert sets == {"humaneval", "spec_bench", "bfcl", "qmsum_longbench"}
    licenses = {s: sorted(f.name for f in (repo / "workloads" / s).glob("LICENSE*")) for s in sets}
    assert licenses == {"humaneval": ["LICENSE"], "spec_bench": ["LICENSE"], "bfcl": ["LICENSE"],
                        "qmsum_longbench": ["LICENSE.LongBench", "LICENSE.QMSum"]}
    assert sum((repo / p).stat().st_size for p in data) < 2_000_000


def test_the_sample_holds_what_its_readme_says():
    from replay.workloads import load_all
    from workloads import SAMPLE_DIR

    counts = {s: len(items) for s, items in load_all(SAMPLE_DIR).items()}
    assert counts == {"code": 46, "tool_call": 78, "prose": 66, "long_context": 30, "code_edit": 40}
    readme = (SAMPLE_DIR / "README.md").read_text(encoding="utf-8")
    for slice_, count in counts.items():
        assert f"**{slice_}** (" in readme and f"({count}" in readme, slice_


def test_nothing_refers_to_a_path_outside_the_repository():
    # a clone stands alone: code, tests and docs cite the repository's own files (docs/runs/ keeps history as it was)
    repo = TESTS.parent
    pattern = re.compile(r"DESIGN\.md|STYLE\.md|\.\./shared")
    offenders = []
    for path in repo.rglob("*"):
        rel = path.relative_to(repo)
        if path.suffix not in (".py", ".md") or rel.parts[0] in (".venv", ".bench-venv", ".git") or \
                rel.parts[:2] == ("docs", "runs") or path == Path(__file__):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{rel}:{number}: {line.strip()[:100]}")
    assert offenders == []


def test_nothing_outside_tests_imports_tests():
    # the product and the benchmarks run from the installed console script, where `tests` is not
    # importable; a benchmark needing a test helper means the helper belongs in bench/ or the product
    repo = TESTS.parent
    offenders = []
    for top in ("gateway", "policies", "backends", "telemetry", "bench", "deploy", "workloads", "replay", "cli",
                "speculation"):
        for path in (repo / top).rglob("*.py"):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                words = line.split()
                if words[:2] in (["import", "tests"], ["from", "tests"]) or (
                        len(words) >= 2 and words[0] in ("import", "from") and words[1].startswith("tests.")):
                    offenders.append(f"{path.relative_to(repo)}:{number}: {line.strip()}")
    assert offenders == []


def test_tests_share_helpers_through_helper_modules_and_never_skip_on_an_import():
    # CONTRIBUTING.md ("Testing"): a helper two test modules need lives in a helpers module or a conftest, never
    # in a test module (importing one runs its module-level code and re-collects nothing it defines); a missing
    # prerequisite skips through tests/prerequisites.py (a failure under CI=true), never with importorskip
    offenders = []
    for path in TESTS.rglob("*.py"):
        if path == Path(__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any(n.startswith("tests.") and n.rsplit(".", 1)[-1].startswith("test_") for n in names):
                offenders.append(f"{path.relative_to(TESTS)}:{node.lineno}: imports {names}")
            if isinstance(node, ast.Attribute) and node.attr == "importorskip":
                offenders.append(f"{path.relative_to(TESTS)}:{node.lineno}: importorskip")
    assert offenders == []


def test_the_product_never_imports_its_benchmarks():
    # docs/architecture.md, "Parts and layers": bench/ is "not imported by the product"; `specgate bench` finds benchmarks through the
    # specgate.bench entry points instead (cli/bench.py)
    repo = TESTS.parent
    offenders = []
    for top in ("gateway", "policies", "backends", "telemetry"):
        for path in (repo / top).rglob("*.py"):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                words = line.split()
                if len(words) >= 2 and words[0] in ("import", "from") and (
                        words[1] == "bench" or words[1].startswith("bench.")):
                    offenders.append(f"{path.relative_to(repo)}:{number}: {line.strip()}")
    assert offenders == []


def _imports_of(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    """Every import under ``folder`` (including ones inside functions or TYPE_CHECKING blocks) of a top-level
    package in ``forbidden``, as ``path:line: import``."""
    repo = TESTS.parent
    offenders = []
    for path in (repo / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            if any(name.split(".")[0] in forbidden for name in names):
                offenders.append(f"{path.relative_to(repo)}:{node.lineno}: {ast.unparse(node)}")
    return offenders


def test_telemetry_imports_no_policy_pool_or_gateway_code():
    # docs/architecture.md, "Parts and layers": telemetry/ reads records and views (telemetry/views.py, built by gateway/telemetry_views.py),
    # never the Policy or the pools
    assert _imports_of("telemetry", ("policies", "backends", "gateway")) == []


def test_the_engine_imports_no_gateway_or_policy_code():
    # the engine takes settings, not policies: calibrate returns plain measurements, policies.costmodel types them
    assert _imports_of("backends/engine", ("policies", "gateway")) == []


def test_ruff_finds_no_undefined_name_unused_import_or_shadowed_definition():
    # pyproject.toml's [tool.ruff.lint]; a deliberate re-export is marked with a noqa comment for F401
    out = subprocess.run([str(Path(sys.executable).with_name("ruff")), "check", "--output-format", "concise", "."],
                         cwd=TESTS.parent, capture_output=True, text=True)
    assert (out.returncode, out.stdout.strip().splitlines()[-1:]) == (0, ["All checks passed!"]), out.stdout


def test_the_gateway_starts_without_scipy_or_numpy():
    # both double the objects a gateway process holds, which every full collection walks on the request path
    # (docs/benchmarks.md, issue 29's gate); the pair gates import SciPy when a test first runs
    code = "import sys, gateway.app; print(sorted({'scipy', 'numpy', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=TESTS.parent, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# The parts, bottom to top (docs/architecture.md, "Parts and layers"): a part may import only parts of a lower
# layer (or its own). Tests and deploy/ are outside the graph.
LAYERS = {"speculation": 0, "workloads": 0, "policies": 1, "telemetry": 1, "backends": 2, "replay": 3, "gateway": 4,
          "cli": 5, "bench": 6}


def import_graph() -> dict[str, set[str]]:
    """Module -> the checkout's modules it imports, at any depth (inside functions and TYPE_CHECKING blocks too,
    so a cycle hidden by a local import still counts)."""
    repo = TESTS.parent
    modules = {}
    for part in LAYERS:
        for path in (repo / part).rglob("*.py"):
            name = ".".join(path.relative_to(repo).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            else:
                continue
            found |= {t for t in map(resolve, targets) if t and t != name}
        graph[name] = found
    return graph


def test_parts_import_only_downward_and_no_module_imports_itself_in_a_cycle():
    graph = import_graph()
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                    if LAYERS[b.split(".")[0]] > LAYERS[a.split(".")[0]]
                    or (LAYERS[b.split(".")[0]] == LAYERS[a.split(".")[0]] and b.split(".")[0] != a.split(".")[0]))
    assert upward == []
    # Tarjan's strongly connected components: any of more than one module is a cycle
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert cycles == []


def test_imports_inside_functions_say_why():
    # issue 59: imports go at the module top; one kept inside a function (a measured start-up cost, a cycle)
    # carries a comment on its line saying why, e.g. "# torch (~2 s): the gateway loads replay"
    repo = TESTS.parent
    offenders = set()
    for part in LAYERS:
        for path in (repo / part).rglob("*.py"):
            source = path.read_text(encoding="utf-8")
            with tokenize.open(path) as f:
                commented = {token.start[0] for token in tokenize.generate_tokens(f.readline)
                             if token.type == tokenize.COMMENT}
            for node in ast.walk(ast.parse(source, str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    offenders |= {f"{path.relative_to(repo)}:{sub.lineno}" for sub in ast.walk(node)
                                  if isinstance(sub, (ast.Import, ast.ImportFrom)) and sub.lineno not in commented}
    assert sorted(offenders) == [], "imports inside functions without a comment saying why (move them to the top)"


def test_every_top_level_part_is_in_the_layers():
    repo = TESTS.parent
    parts = {p.parent.name for p in repo.glob("*/__init__.py")} - {"tests"}
    assert parts == set(LAYERS)
