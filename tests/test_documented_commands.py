"""Every command README.md and docs/*.md show runs as written, through the installed console script.

Collected from fenced shell blocks (``bash``, ``sh``, ``shell``, ``console`` or unlabelled) whose line starts
with `.venv/bin/specgate`, `specgate`, `.venv/bin/python -m` or `python -m`. Each runs with ``--help`` from a
directory outside the repository, as a reader's shell would (so a module that imports ``tests``, or only
works with the repository root on ``sys.path``, fails here), and every ``--flag`` the docs show must be in
that help. The commands that need data or a running stack also run for real in a short form
(``SHORT_RUNS``): a renamed flag or a moved module fails CI instead of a reader.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli import build_parser

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
COMMAND = re.compile(r"^(?:\.venv/bin/)?(?:specgate|python -m) ")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def documented_commands() -> dict[str, list[str]]:
    """``file:line`` -> argv of each documented command (comments, redirections and ``[...]`` marks off)."""
    found = {}
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for block in FENCE.finditer(text):
            if block.group(1) not in SHELL_LANGS:
                continue
            first_line = text.count("\n", 0, block.start(2)) + 1
            lines = block.group(2).splitlines()
            for offset, line in enumerate(lines):
                if not COMMAND.match(line.strip()):
                    continue
                while line.endswith("\\") and offset + 1 < len(lines):  # continued on the next line
                    offset += 1
                    line = line[:-1] + " " + lines[offset]
                words = shlex.split(line, comments=True)
                words = words[:words.index(">")] if ">" in words else words
                argv = [w.strip("[]") for w in words]
                found[f"{doc.relative_to(REPO)}:{first_line + offset}"] = argv
    return found


COMMANDS = documented_commands()


def _run(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _subcommand_path(words: list[str]) -> list[str]:
    """The leading words of a `specgate` command line that name (sub)commands; the next word, if the
    command there has subcommands, must be one of them."""
    parser, path = build_parser(), []
    for word in words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            break
        assert word in subs[0].choices, f"`{' '.join(['specgate', *path, word])}`: no such command; " \
                                        f"choose from {sorted(subs[0].choices)}"
        parser = subs[0].choices[word]
        path.append(word)
    return path


def help_argv(argv: list[str]) -> list[str]:
    """The installed entry point's ``--help`` for a documented command line."""
    program = Path(argv[0]).name
    if program == "specgate":
        return [str(BIN / "specgate"), *_subcommand_path(argv[1:]), "--help"]
    assert program in ("python", "python3") and argv[1] == "-m", f"not a documented command form: {argv}"
    return [str(BIN / "python"), "-m", argv[2], "--help"]


def test_the_docs_show_commands_of_every_form():
    forms = {(Path(argv[0]).name, argv[1] if argv[1] != "-m" else argv[2]) for argv in COMMANDS.values()}
    assert {("specgate", "bench"), ("specgate", "policy"), ("specgate", "worker"),
            ("python", "bench.engine"), ("python", "bench.reliability")} <= forms, sorted(forms)


@pytest.mark.parametrize("where", sorted(COMMANDS))
def test_documented_command_runs_with_help_outside_the_repository(where, tmp_path):
    argv = COMMANDS[where]
    done = _run(help_argv(argv), tmp_path, timeout=120)
    assert done.returncode == 0, f"{where}: `{shlex.join(help_argv(argv))}` failed:\n{done.stderr[-3000:]}"
    flags = sorted({w.split("=", 1)[0] for w in argv if w.startswith("--")})
    unknown = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", done.stdout)]
    assert unknown == [], f"{where}: {unknown} not in the help of `{shlex.join(argv)}`"


# Short real runs of documented commands that need data, a model or a running stack. Each key is the
# start of a documented command line (test_every_short_run_stands_for_a_documented_command checks it).
def _reliability(tmp: Path) -> tuple[list[str], float]:
    # the command's plumbing and report, end to end; the overload and faults scenarios each have their own
    # test in tests/reliability (test_serving.py), which runs the same scenario functions on shared workers
    return ["bench", "reliability", "--clients", "8", "--soak-s", "10", "--disconnects", "4",
            "--reload-rounds", "1", "--scenarios", "soak", "reloads", "--out", str(tmp / "reliability.json")], 900


def _merge(tmp: Path) -> tuple[list[str], float]:
    parts = [str(REPO / "docs" / "runs" / "full" / p) for p in ("c1", "c4", "c16", "p0.25", "p0.5")]
    return ["bench", "serve", "--merge", *parts, "--out", str(tmp / "merged")], 300


def _report(tmp: Path) -> tuple[list[str], float]:
    shutil.copytree(REPO / "docs" / "runs" / "full" / "merged", tmp / "merged")
    return ["bench", "serve", "--report", str(tmp / "merged")], 300


def _policy_check(tmp: Path) -> tuple[list[str], float]:
    return ["policy", "check", str(REPO / "deploy" / "policies" / "default.yaml")], 60


def _policy_explain(tmp: Path) -> tuple[list[str], float]:
    request = tmp / "request.json"
    request.write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 64, "messages": [
        {"role": "user", "content": "def add(a, b):\n    return a + b\n\n# write mul(a, b) like add\n"}]}))
    return ["policy", "explain", str(REPO / "deploy" / "policies" / "default.yaml"), "--request", str(request),
            "--json"], 60


SHORT_RUNS = {
    "specgate bench reliability": _reliability,
    "specgate bench serve --merge": _merge,
    "specgate bench serve --report": _report,
    "specgate policy check": _policy_check,
    "specgate policy explain": _policy_explain,
}


def test_every_short_run_stands_for_a_documented_command():
    shown = {shlex.join(["specgate", *argv[1:]]) for argv in COMMANDS.values() if Path(argv[0]).name == "specgate"}
    assert [k for k in SHORT_RUNS if not any(s.startswith(k) for s in shown)] == []


@pytest.mark.integration
@pytest.mark.parametrize("command", sorted(SHORT_RUNS))
def test_documented_command_runs_for_real_in_a_short_form(command, tmp_path, prepared_model):
    args, timeout = SHORT_RUNS[command](tmp_path)
    work = tmp_path / "cwd"
    work.mkdir()
    done = _run([str(BIN / "specgate"), *args], work, timeout)
    assert done.returncode == 0, f"`specgate {shlex.join(args)}` exited {done.returncode}:\n" \
                                 f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    if command == "specgate bench reliability":
        report = json.loads((tmp_path / "reliability.json").read_text())
        assert set(report) == {"args", "soak", "disconnects", "reloads"}
        assert report["soak"]["requests"] > 0 and report["soak"]["exact"] == report["soak"]["requests"]
        assert report["reloads"]["failed"] == 0, report["reloads"]
    elif command == "specgate bench serve --merge":
        assert {"serve.json", "serve.md"} <= {p.name for p in (tmp_path / "merged").iterdir()}
    elif command == "specgate bench serve --report":
        assert (tmp_path / "merged" / "serve.md").read_text() == \
            (REPO / "docs" / "runs" / "full" / "merged" / "serve.md").read_text()
    elif command == "specgate policy explain":
        explained = json.loads(done.stdout)
        assert explained["slice"] == "code", explained["slice"]
        assert [r["rule"] for r in explained["rules"] if r["matched"]] == ["learned"], explained["rules"]


def readme_first_benchmark() -> list[str]:
    """The first benchmark command the README shows (``python -m bench.*`` or ``specgate bench``)."""
    for where, argv in COMMANDS.items():
        if where.startswith("README.md:") and (argv[1:3] == ["-m", argv[2]] and argv[2].startswith("bench.")
                                               or argv[1:2] == ["bench"]):
            return argv
    raise AssertionError("README.md shows no benchmark command")


@pytest.mark.integration
@pytest.mark.real_model
def test_a_fresh_clone_with_nothing_beside_it_runs_the_readme(tmp_path, prepared_model):
    """A clone into an empty folder (no sibling folders, so nothing outside the repository can be read) runs the
    README's set-up, the tests that read workloads and the README's first benchmark on its default workloads.

    The set-up is `make setup` as written, with this checkout's virtualenv standing in for the one the clone
    would build (``VENV=``; the clone's pyproject.toml is dated back so make sees that venv as installed and
    does not re-point its editable install at the clone). Every command runs with the clone as its working
    directory, so ``python -m`` imports the clone's code."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")  # an installed copy of the tests; CI always runs in a clone
    clone = tmp_path / "empty" / "specgate"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=300)
    assert sorted(p.name for p in clone.parent.iterdir()) == ["specgate"]
    venv = BIN.parent
    stamp = venv / ".installed"
    if stamp.exists():
        os.utime(clone / "pyproject.toml", (stamp.stat().st_mtime - 60,) * 2)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECGATE_WORKLOADS")}

    def run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        done = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"`{shlex.join(argv)}` exited {done.returncode} in the clone:\n" \
                                     f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        return done

    run(["make", "setup", f"VENV={venv}"], timeout=600)
    tests = ["tests/bench/test_workloads.py", "tests/test_layout.py",
             "tests/replay/test_trace_build.py::test_build_from_the_workloads"]
    done = run([str(BIN / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not full", *tests],
               timeout=900)
    assert re.search(r"^\d+ passed", done.stdout.splitlines()[-1]) and "skipped" not in done.stdout, done.stdout
    argv = readme_first_benchmark()
    argv = [str(BIN / Path(argv[0]).name), *argv[1:]]
    done = run(argv, timeout=900)
    header, _ = json.JSONDecoder().raw_decode(done.stdout)  # the benchmark prints its header first
    from replay.workloads import SLICES, sample

    drawn = sample(clone / "workloads", 1, 0, 3000)
    assert header["prompts"] == {s: [i.id for i in drawn if i.slice == s] for s in SLICES}
    assert "engine-plain" in done.stdout, done.stdout[-2000:]


def test_every_page_says_first_who_it_is_for():
    # docs are organised by what a reader came to do: each page opens with whom it serves
    pages = [*DOCS, REPO / "CONTRIBUTING.md", REPO / "workloads" / "README.md"]
    openings = {p.relative_to(REPO).as_posix(): next(line for line in p.read_text(encoding="utf-8").splitlines()[1:]
                                                     if line.strip()) for p in pages}
    assert {page: line for page, line in openings.items() if not line.startswith("For ")} == {}


def test_the_readme_and_the_results_page_stay_short():
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 170
    assert len((REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines()) <= 400
