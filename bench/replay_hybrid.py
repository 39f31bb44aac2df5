"""The hybrid proposer measured with replay: its arms against fixed suffix, the per-round n-gram pool and the
per-round oracle over both sources, side by side on one trace and cost model.

    python -m bench.replay_hybrid --trace TRACE --costs COSTS [--loads c1 c4] [--seeds 5]
        [--arms suffix-k8 suffix-k16 ngram-k16-beta hybrid-k8 hybrid-k16-beta hybrid-k16-oracle]

Prints per load: every arm's paired geomean TPOT ratio over the baseline (the first arm) and over the best
non-oracle arm of that load, with 95% intervals over seeds, and its accept length; and per slice the ratio of
each hybrid arm over the slice's best fixed (non-hybrid, non-oracle) arm. Suffix drafts from the requests
admitted before (arrival order: replay/hybrid.py), so every arm runs every seed.
"""

from __future__ import annotations

import argparse
import sys

from policies.costmodel import load_cost_model
from policies.trace import read_trace
from replay.book import RoundBook
from replay.choosers import Prices
from replay.report import ALL, ratio, split
from replay.run import parse_arm, sweep

ARMS = ("suffix-k8", "suffix-k16", "ngram-k16-beta", "hybrid-k8", "hybrid-k16-beta", "hybrid-k16-oracle")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay_hybrid", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--costs", required=True)
    parser.add_argument("--arms", nargs="+", default=list(ARMS))
    parser.add_argument("--loads", nargs="+", default=["c1", "c4"])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=1)
    args = parser.parse_args(argv)
    print("command: python -m bench.replay_hybrid " + " ".join(argv if argv is not None else sys.argv[1:]))

    trace = read_trace(args.trace)
    book = RoundBook(trace)
    prices = Prices(book, load_cost_model(args.costs, revision=trace.header.revision))
    results = sweep(prices, [parse_arm(n, book) for n in args.arms], args.loads, args.seeds, "interleaved",
                    max_running=16, max_total_tokens=1 << 16, processes=args.processes)
    slice_of = {i: r.slice for i, r in enumerate(trace.requests)}.__getitem__
    groups = split(results, slice_of)
    slices = list(dict.fromkeys(r.slice for r in trace.requests if r.output_ids))
    base = args.arms[0]
    served = [n for n in args.arms if "-oracle" not in n]
    fixed = [n for n in served if not n.startswith("hybrid")]
    print(f"{len(trace.requests)} requests, {args.seeds} seeds, loads {' '.join(args.loads)}")
    for load in args.loads:
        best = min(served, key=lambda n: ratio(groups, n, base, load, ALL, args.seeds)["ratio"] if n != base else 1.0)
        print(f"\n## {load}: TPOT ratio (paired geomean [95%]) over {base} and over the best served arm ({best})")
        for name in args.arms:
            rows = [ratio(groups, name, other, load, ALL, args.seeds) if name != other else None
                    for other in (base, best)]
            cells = ["1" if r is None else f"{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}]" for r in rows]
            rounds = sum(s.verify_ct for seed in range(args.seeds) for s in results[(name, load, seed)])
            tokens = sum(s.tokens for seed in range(args.seeds) for s in results[(name, load, seed)])
            print(f"{name:20s} {cells[0]:26s} {cells[1]:26s} accept length {tokens / rounds:.2f}")
        for slice_ in slices:
            cell_best = min(fixed, key=lambda n: ratio(groups, n, base, load, slice_, args.seeds)["ratio"]
                            if n != base else 1.0)
            line = [f"{name} {ratio(groups, name, cell_best, load, slice_, args.seeds)['ratio']:.3f}"
                    for name in args.arms if name.startswith("hybrid")]
            print(f"  {slice_:14s} over {cell_best:15s} " + "  ".join(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
