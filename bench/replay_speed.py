"""Replay's speed: N requests against the fixed arms and a policy at three loads and S seeds.

    python -m bench.replay_speed --trace TRACE --costs COSTS [--requests 10000] [--seeds 20]

The bar: 10,000 requests, 8 contenders, 3 loads, 20 seeds in under 5 minutes on this
2-core machine. The N requests are the trace's, repeated with new ids until there are N (each copy is
replayed from scratch: nothing is shared between copies), in one interleaved stream per seed. Prints the
wall time of each phase and of each contender (one sweep per contender, its rounds and profiles included).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from msgspec import structs

from replay.book import RoundBook
from replay.choosers import Prices
from replay.run import Contender, load_policy, parse_arm, sweep
from policies.costmodel import load_cost_model
from policies.trace import read_trace, write_trace

REPO = Path(__file__).resolve().parents[1]
ARMS = ("plain", "ngram-k2", "ngram-k4", "ngram-k8", "suffix-k8", "draft-k2", "draft-k4")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--costs", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--loads", nargs="+", default=["c1", "c16", "p0.5"])
    parser.add_argument("--arms", nargs="+", default=list(ARMS))
    parser.add_argument("--policy", default=str(REPO / "deploy/policies/default.yaml"),
                        help="the policy contender's file; none: the arms alone")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    base = read_trace(args.trace)
    requests = [structs.replace(base.requests[n % len(base.requests)], id=f"{n}", arrival_s=float(n))
                for n in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.jsonl"
        write_trace(path, base.header, requests)
        t1 = time.perf_counter()
        trace = read_trace(path)
    t2 = time.perf_counter()
    book = RoundBook(trace)
    prices = Prices(book, load_cost_model(args.costs, revision=trace.header.revision))
    contenders = [parse_arm(a, book) for a in args.arms]
    if args.policy != "none":
        contenders.append(Contender(Path(args.policy).stem, policy=load_policy(args.policy)))
    simulated, per = 0, []
    for contender in contenders:  # one sweep each: its time per simulated request is printed
        started = time.perf_counter()
        results = sweep(prices, [contender], args.loads, args.seeds, "interleaved", max_running=16,
                        max_total_tokens=65536, processes=args.processes)
        count = sum(len(v) for v in results.values())
        per.append((contender.name, time.perf_counter() - started, count))
        simulated += count
        print(f"  {contender.name}: {per[-1][1]:.1f} s, {1e6 * per[-1][1] / count:.1f} us per simulated request "
              "(its rounds and profiles included)", file=sys.stderr)
    t3 = time.perf_counter()
    print(f"{args.requests} requests x {len(contenders)} contenders x {len(args.loads)} loads x {args.seeds} seeds "
          f"({simulated} simulated requests, {args.processes} processes)")
    for name, seconds, count in per:
        print(f"  {name}: {seconds:.1f} s ({1e6 * seconds / count:.1f} us per simulated request)")
    print(f"write + read the trace: {t1 - t0:.1f} + {t2 - t1:.1f} s; rounds and simulation: {t3 - t2:.1f} s; "
          f"total {t3 - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
