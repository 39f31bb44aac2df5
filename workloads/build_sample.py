"""Rebuild the shipped workload sample from a full copy of the sets (the rule is in README.md beside this file).

    python -m workloads.build_sample --source /path/to/full/workloads --out workloads

Lines are copied byte for byte, in upstream order: the first items of each file (of each Spec-Bench category),
so anything that takes "the first N" of a set draws the same prompts from the sample as from the full set.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# items kept per file (Spec-Bench: per category; BFCL: per category file, with its possible answers)
HUMANEVAL = 40
SPEC_BENCH = {"summarization": 12, "rag": 12, "translation": 8, "qa": 8, "math_reasoning": 8}
SPEC_BENCH_DEFAULT = 6  # MT-bench's categories (coding, writing, ...): all six each
BFCL = 6
QMSUM = 6
LICENSES = {"humaneval": ["LICENSE"], "spec_bench": ["LICENSE"], "bfcl": ["LICENSE"],
            "qmsum_longbench": ["LICENSE.QMSum", "LICENSE.LongBench"]}


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True) if line.strip()]


def _write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines), encoding="utf-8")


def build(source: Path, out: Path) -> dict[str, int]:
    """Write the sample under ``out``; returns the number of items kept per file."""
    kept: dict[str, int] = {}
    for folder, names in LICENSES.items():
        for name in names:
            (out / folder).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / folder / name, out / folder / name)
    lines = _lines(source / "humaneval" / "HumanEval.jsonl")[:HUMANEVAL]
    _write(out / "humaneval" / "HumanEval.jsonl", lines)
    kept["humaneval/HumanEval.jsonl"] = len(lines)
    taken: dict[str, int] = {}
    spec = []
    for line in _lines(source / "spec_bench" / "question.jsonl"):
        category = json.loads(line)["category"]
        if taken.get(category, 0) < SPEC_BENCH.get(category, SPEC_BENCH_DEFAULT):
            taken[category] = taken.get(category, 0) + 1
            spec.append(line)
    _write(out / "spec_bench" / "question.jsonl", spec)
    kept["spec_bench/question.jsonl"] = len(spec)
    for path in sorted((source / "bfcl").glob("BFCL_v4_*.jsonl")):
        lines = _lines(path)[:BFCL]
        _write(out / "bfcl" / path.name, lines)
        kept[f"bfcl/{path.name}"] = len(lines)
        answers = source / "bfcl" / "possible_answer" / path.name
        if answers.exists():
            ids = {json.loads(line)["id"] for line in lines}
            _write(out / "bfcl" / "possible_answer" / path.name,
                   [line for line in _lines(answers) if json.loads(line)["id"] in ids])
    lines = _lines(source / "qmsum_longbench" / "qmsum_test_prompts.jsonl")[:QMSUM]
    _write(out / "qmsum_longbench" / "qmsum_test_prompts.jsonl", lines)
    kept["qmsum_longbench/qmsum_test_prompts.jsonl"] = len(lines)
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="a full copy of the sets (same layout)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="default: this folder")
    args = parser.parse_args(argv)
    if not (args.source / "humaneval" / "HumanEval.jsonl").is_file():
        print(f"--source {args.source}: no humaneval/HumanEval.jsonl there; pass a full copy of the sets",
              file=sys.stderr)
        return 1
    for name, count in build(args.source, args.out).items():
        print(f"{name}: {count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
