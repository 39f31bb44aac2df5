"""The cost of learning for a fleet of gateways against one gateway, in replay (the gateway's real ``decide()`` and
learner on a simulated clock, replay/choosers.PolicyChooser).

    python -m bench.replay_fleet --trace TRACE --costs COSTS [--policy deploy/policies/default.yaml]
        [--loads c1 c4 c16 p0.5] [--seeds 10] [--replicas 3] [--sync-s 1] [--window 10]

Contenders:
- ``one gateway``: one learner takes every request;
- ``fleet of N, shared``: ``--replicas`` gateways take the requests in turn (round robin, as a Service spreads them)
  and share their sums and explorations in flight as gateway/fleet.py does every ``--sync-s``; each decides from
  the others' evidence as of the sync round before last (two intervals: the staleness bound of a flush then a read);
- ``fleet of N, alone``: the same gateways sharing nothing (a fleet without ``state:``, as before the fleet issue).

Per seed and load, each contender serves the trace's requests in the seed's order twice, on fresh simulated
engines: from cold, and warmed up (its learners first served the whole trace in another order). The suffix trees
and the engine's own per-round controller start empty both times, so what differs is what the gateways' learners
learned: this measures the gateways' cost of learning, not the engine's. The cold stream is cut into windows of
about ``--window`` requests per slice (the interleaved order spreads the slices); a window's figure is its requests'
TPOT from cold over the same requests' TPOT warm (paired geomean, 95% interval over seeds). "Requests per slice
until within 5% of warm" is the end of the last window whose mean is above ``--within`` (default 1.05; 0: within
from the first window on).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import statistics
from pathlib import Path

from policies.costmodel import load_cost_model
from policies.trace import read_trace
from replay.book import RoundBook
from replay.choosers import PolicyChooser, Prices, RunState
from replay.report import interval
from replay.run import blocks, load_policy
from replay.sim import Load, Simulation

REPO = Path(__file__).resolve().parents[1]
_CONTEXT: dict = {}  # what the forked workers share: prices, policy, settings


def contenders(replicas: int, sync_s: float) -> dict[str, tuple[int, float | None]]:
    """Name -> (replicas, sync interval or None)."""
    return {"one gateway": (1, None), f"fleet of {replicas}, shared": (replicas, sync_s),
            f"fleet of {replicas}, alone": (replicas, None)}


def learning_run(job: tuple[str, str, int]) -> tuple[tuple[str, str, int], list[float]]:
    """One contender at one load and seed: per window of the measured stream, the mean log TPOT ratio of its
    requests served from cold over the same requests served by the same contender warmed up first."""
    name, load, seed = job
    prices, policy, window, max_running = (_CONTEXT[k] for k in ("prices", "policy", "window", "max_running"))
    replicas, sync_s = _CONTEXT["contenders"][name]
    book = prices.book
    measured, other = blocks(book, "interleaved", seed)[0], blocks(book, "interleaved", seed + 10_000)[0]

    def chooser() -> PolicyChooser:
        return PolicyChooser(policy, prices, seed, without_flags="exclude", replicas=replicas, sync_s=sync_s)

    def serve(who: PolicyChooser, order: list[int], start: float) -> Simulation:
        sim = Simulation(who, Load.parse(load), [order], seed, max_running=max_running, max_total_tokens=1 << 16,
                         start=start)
        sim.run()
        return sim

    warm = chooser()
    start = serve(warm, other, 0.0).now  # the warm-up: the whole trace in another order
    warm.run = RunState(seed)  # empty suffix trees again: only what the learners learned carries over
    warmed = {s.index: s.tpot for s in serve(warm, measured, start).served if s.tpot}
    cold = serve(chooser(), measured, start).served
    size = window * len({r.slice for r in book.requests})
    arrived = sorted(cold, key=lambda s: (s.arrival, s.index))
    curve = []
    for w in range(0, len(arrived), size):
        logs = [math.log(s.tpot / warmed[s.index]) for s in arrived[w:w + size] if s.tpot and s.index in warmed]
        curve.append(statistics.fmean(logs) if logs else 0.0)
    return job, curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay_fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True, help="specgate trace build's output")
    parser.add_argument("--costs", type=Path, required=True, help="specgate trace calibrate's output")
    parser.add_argument("--policy", type=Path, default=REPO / "deploy/policies/default.yaml")
    parser.add_argument("--loads", nargs="+", default=["c1", "c4", "c16", "p0.5"])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--sync-s", type=float, default=1.0, help="the fleet's sync interval (state.sync_interval_s)")
    parser.add_argument("--window", type=int, default=10, help="requests per slice in a window of the curve")
    parser.add_argument("--within", type=float, default=1.05, help="the ratio to warm that counts as learned")
    parser.add_argument("--max-running-requests", type=int, default=16)
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)

    trace = read_trace(args.trace)
    prices = Prices(RoundBook(trace), load_cost_model(args.costs, revision=trace.header.revision))
    named = contenders(args.replicas, args.sync_s)
    _CONTEXT.update(prices=prices, policy=load_policy(args.policy), window=args.window,
                    contenders=named, max_running=args.max_running_requests)
    jobs = [(name, load, seed) for seed in range(args.seeds) for load in args.loads for name in named]
    with multiprocessing.get_context("fork").Pool(args.processes) as pool:
        results = dict(pool.imap_unordered(learning_run, jobs))
    slices = len({r.slice for r in trace.requests})
    per_slice = len(trace.requests) // slices
    print(f"# {args.trace}: {len(trace.requests)} requests ({per_slice} per slice), policy {args.policy}, "
          f"{args.seeds} seeds, windows of {args.window} requests per slice, "
          f"sync every {args.sync_s:g} s\n")
    print(f"## Requests per slice until within {args.within - 1:.0%} of warm (TPOT of each window over the same "
          "requests warm, paired geomean over seeds)\n")
    print("| load | " + " | ".join(named) + " | shared fleet / one gateway |")
    print("|---|" + "---:|" * (len(named) + 1))
    curves: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for load in args.loads:
        until = {}
        for name in named:
            runs = [results[(name, load, seed)] for seed in range(args.seeds)]
            curve = [tuple(math.exp(x) for x in interval([run[w] for run in runs])) for w in range(len(runs[0]))]
            curves[(name, load)] = curve
            above = [w for w, (mean, _, _) in enumerate(curve) if mean > args.within]
            until[name] = 0 if not above else (above[-1] + 1) * args.window
        shared, one = until[list(named)[1]], until["one gateway"]
        last = len(curve) * args.window  # the end of the stream: never within --within of warm
        print(f"| {load} | " + " | ".join(f"{until[n]}" if until[n] < last else f">= {last}" for n in named)
              + f" | {'-' if one == 0 else f'{shared / one:.2f}'} |")
    print("\n## The learning curves: each window's TPOT over warm, paired geomean [95% over seeds]\n")
    for (name, load), curve in curves.items():
        cells = " ".join(f"{mean:.3f}" for mean, _, _ in curve)
        first = curve[0]
        print(f"- {load} {name}: {cells}  (first window {first[0]:.3f} [{first[1]:.3f}, {first[2]:.3f}])")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
