"""How a policy's slices classify the benchmark workloads: each prompt's family (its label from the workloads'
slice mapping, replay/workloads.py) against the slice the policy gives it, with the requests it puts elsewhere.

    python -m bench.slices [--policy deploy/policies/default.yaml] [--workloads DIR] [--show 20] [--time]

The gateway's own code does the classifying (policies.features.features_from_openai, policies.slicing.classify),
on the request body the benchmarks send. ``code_edit`` is a family of the workloads, not a slice of the default
policy: its requests are expected in ``code``. Without ``--workloads``, the repository's sample (workloads/).
``--time`` adds what the request features cost per request of each family: with ``code_score`` always computed,
and as the gateway computes them (only when deciding reads it, policies.slicing.needs_code_score).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from policies.features import asks_for_code, features_from_openai, prompt_text
from policies.load import load_policy_file
from policies.slicing import classify, needs_code_score
from replay.workloads import load_all

REPO = Path(__file__).resolve().parent.parent


def confusion(policy_path: Path, workloads: Path | None) -> tuple[dict[str, collections.Counter], list[tuple]]:
    """Per family, how many of its requests went to each slice; and (family, slice, code_score, item) for those
    whose slice is not their family (``code_edit`` in ``code`` counts as its own)."""
    policy = load_policy_file(policy_path)
    table: dict[str, collections.Counter] = {}
    elsewhere = []
    for family, items in load_all(workloads).items():
        counts = table.setdefault(family, collections.Counter())
        for item in items:
            features = features_from_openai(item.chat_body(), repeat=False)
            got, _ = classify(policy, features)
            counts[got] += 1
            if got != family and (family, got) != ("code_edit", "code"):
                elsewhere.append((family, got, features.code_score, item))
    return table, elsewhere


def _median_us(fn: Callable[[], object], calls: int) -> float:
    runs = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        runs.append(time.perf_counter_ns() - t0)
    return statistics.median(runs) / 1e3


def feature_costs(policy_path: Path, workloads: Path | None, calls: int = 20) -> dict[str, tuple[float, ...]]:
    """Per family, the mean over its requests of the median microseconds of: every feature with ``code_score``
    always computed; every feature as the gateway computes them for the policy (``code_score`` only when
    deciding reads it); ``asks_for_code`` alone; and the slowest request's first figure."""
    policy = load_policy_file(policy_path)
    needs = partial(needs_code_score, policy)
    out = {}
    for family, items in load_all(workloads).items():
        rows = []
        for item in items:
            body = item.chat_body()
            text = prompt_text(body)
            rows.append((_median_us(lambda: features_from_openai(body, repeat=False), calls),
                         _median_us(lambda: features_from_openai(body, repeat=False, code=needs), calls),
                         _median_us(lambda: asks_for_code(text), calls)))
        out[family] = (*(statistics.fmean(col) for col in zip(*rows)), max(row[0] for row in rows))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.slices", description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", type=Path, default=REPO / "deploy/policies/default.yaml")
    parser.add_argument("--workloads", type=Path, default=None, help="a full copy of the sets (default: the sample)")
    parser.add_argument("--show", type=int, default=20, help="list at most this many requests put elsewhere")
    parser.add_argument("--time", action="store_true", help="also time the estimators per request")
    args = parser.parse_args(argv)
    table, elsewhere = confusion(args.policy, args.workloads)
    slices = sorted({s for counts in table.values() for s in counts})
    print(f"command: python -m bench.slices {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    shown = args.policy.resolve()
    shown = shown.relative_to(REPO) if shown.is_relative_to(REPO) else shown
    print(f"policy: {shown}; workloads: {args.workloads or 'the repository sample (workloads/)'}")
    print("| family | requests | " + " | ".join(slices) + " |")
    print("|---|---:|" + "---:|" * len(slices))
    for family, counts in table.items():
        print(f"| {family} | {sum(counts.values())} | " + " | ".join(str(counts[s]) for s in slices) + " |")
    print(f"\n{len(elsewhere)} requests in a slice other than their family's:")
    for family, got, score, item in elsewhere[:args.show]:
        text = item.messages[-1].get("content") if item.messages else ""
        text = (text if isinstance(text, str) else "").replace("\n", " ")[:80]
        print(f"  {family} -> {got} (code_score {score}) {item.source}: {text!r}")
    if args.time:
        print("\nFeatures per request, us (mean over the family's requests of the median of 20 calls):")
        print("| family | code_score always | as the gateway computes them | asks_for_code alone | slowest, always |\n"
              "|---|---:|---:|---:|---:|")
        for family, (always, lazy, ask, slowest) in feature_costs(args.policy, args.workloads).items():
            print(f"| {family} | {always:.1f} | {lazy:.1f} | {ask:.1f} | {slowest:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
