"""Per-round draft length measured with replay: specgate's controller against every fixed arm and against the
engines' own adaptive algorithms, on the mixed stream and per slice, at each load.

    python -m bench.replay_adaptive --trace TRACE --costs COSTS [--loads c1 c4 c16 p0.25 p0.5] [--seeds 20]
        [--policy FILE ...]

Contenders: the fixed arms (plain, n-gram k in --ks; draft-k2 if the trace has a self-draft pair), specgate's
per-round controller (``ngram-k{K}-beta``), SGLang's ``--speculative-adaptive`` at its usual launch
(``ngram-k7-sglang``: steps {1, 3, 7}) and vLLM's per-batch-size table (``ngram-k{K}-vllm=TABLE``), tuned
here as its docs ask, offline, per hardware: at each closed-loop load the fixed n-gram k with the best mixed
geomean TPOT, keyed by that load's concurrency (so the table is the best fixed arm of every c-load). A last
column, ``oracle:per-request``, is every request served by the fixed arm that was fastest for it, chosen after
the fact (exact at c1; under load a reference). Two more references choose k per round knowing what no engine
knows (replay/walk.Clairvoyant): ``ngram-k{K}-informed`` the trace's own acceptance rate of every draft
position in every n-gram match context (in-sample: the best a controller predicting from the match length
alone can know), ``ngram-k{K}-oracle`` every round's accepted run (perfect prediction). The gap between them
is what a better predictor of a round's acceptance could still win; the gap between the controller and
``informed`` is what learning costs. ``--informed request+match ...`` adds ``informed`` references keyed by other
features of a round known before it is verified (replay/book.FEATURES): whether any predictor from them
could reach a target.

Prints, per load: (1) mixed stream, paired geomean TPOT of each per-round contender over the best single
fixed arm of that load (and over plain), 95% interval over seeds; (2) per slice x load cell, specgate's p50
TPOT over the cell's best fixed arm (target <= 1.03), its SLO goodput over that arm's (>= 0.97) and its p50
TPOT over plain's (<= 1.0); at c1, how far the worker's plain estimate (``Served.plain_ratio``, what auto
learns plain from) is from the plain arm's measured TPOT, request by request; (3) the cost of learning: the stream replayed twice on one engine, the first
pass (cold: the engine's pooled acceptance empty) over the second (warm), paired geomean TPOT.

``--policy FILE`` adds a gateway policy (``auto``'s Thompson sampling, policies/auto.py, deciding per request
through the real ``decide``) as a contender, ``policy:NAME``: per seed the stream is served twice on one
engine and one learner, a warm-up pass in another order and then the measured pass; its cost of learning is the
warm-up pass over the measured one, paired. The learning target, "from cold, within 5% of warm after <= 30
requests per slice", is a second run per seed (``--learning-seeds``):
one learner from cold serves three passes in three orders; pass 1 (learning) and pass 2 (after one pass, 16
requests per slice on an 80-request trace) over pass 3 (warm), paired.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

from replay.book import FEATURES, RoundBook
from replay.choosers import FixedChooser, PolicyChooser, Prices
from replay.report import ALL, interval, ratio, split, summarise
from replay.run import blocks, load_policy, parse_arm, sweep
from replay.sim import Load, Simulation
from policies.costmodel import load_cost_model
from policies.trace import read_trace
from telemetry.progress import Progress

SLO = (2.0, 0.150)  # deploy/policies/default.yaml


def vllm_table(results: dict, fixed: list[str], loads: list[str], seeds: int, slice_of) -> str:
    """The best fixed n-gram k at each closed-loop load, as LO:K entries of vLLM's schedule."""
    groups = split(results, slice_of)
    entries = []
    for load in loads:
        c = Load.parse(load).concurrency
        if c is None:
            continue
        scores = {n: ratio(groups, n, "plain", load, ALL, seeds)["ratio"] for n in fixed if n.startswith("ngram")}
        entries.append((c, int(min(scores, key=scores.get).split("-k")[1])))
    return ",".join(f"{c}:{k}" for c, k in sorted(entries)) or "1:4"


ORACLE = "oracle:per-request"


def per_request_oracle(results: dict, fixed: list[str], load: str, seed: int) -> list:
    """Each request as the fixed arm that served it fastest, chosen after the fact: what a per-request choice
    among the fixed arms could reach at best. Exact at c1 (a request alone); under load each arm's run had every
    request on that arm, so the mix is a reference, not a world that ran."""
    best: dict[int, object] = {}
    for name in fixed:
        for s in results[(name, load, seed)]:
            if s.tpot and (s.index not in best or s.tpot < best[s.index].tpot):
                best[s.index] = s
    return list(best.values())


def plain_estimate_error(prices: Prices, arm: str, plain: list, max_running: int) -> tuple[float, float, int]:
    """At c1 (seed 0's order): log(the worker's plain estimate for each request served by ``arm`` / the plain
    arm's measured TPOT of it), mean and sd over requests, and their number."""
    book = prices.book
    chooser = FixedChooser(parse_arm(arm, book).option, prices, 0)
    chooser.plain_estimates = True
    served = Simulation(chooser, Load.parse("c1"), [blocks(book, "interleaved", 0)[0]], 0, max_running=max_running,
                        max_total_tokens=1 << 16).run()
    measured = {s.index: s.tpot for s in plain if s.tpot}
    logs = [math.log(s.tpot * s.plain_ratio / measured[s.index]) for s in served
            if s.tpot and s.plain_ratio and s.index in measured]
    return statistics.fmean(logs), statistics.pstdev(logs), len(logs)


def cold_over_warm(prices: Prices, arm: str, load: str, seeds: int, max_running: int) -> tuple[float, float, float]:
    """Geomean TPOT of the first pass over the second when the stream is served twice on one engine."""
    book = prices.book
    logs = []
    for seed in range(seeds):
        order = blocks(book, "interleaved", seed)[0]
        chooser = FixedChooser(parse_arm(arm, book).option, prices, seed)
        served = Simulation(chooser, Load.parse(load), [order, order], seed, max_running=max_running,
                            max_total_tokens=1 << 16).run()
        cold, warm = served[:len(order)], served[len(order):]
        tpot = {s.index: s.tpot for s in warm if s.tpot}
        logs.append(statistics.fmean(math.log(s.tpot / tpot[s.index]) for s in cold if s.tpot and s.index in tpot))
    mean, lo, hi = interval(logs)
    return math.exp(mean), math.exp(lo), math.exp(hi)


def warm_policy(prices: Prices, policy, load: str, seed: int, max_running: int, warmups: int = 1) -> list[list]:
    """The passes of a policy, ``warmups`` warm-up passes then the measured one: one learner and one engine
    serve the stream in other seeds' orders, then in this seed's order (the fixed arms' order, so requests
    pair)."""
    book = prices.book
    orders = [blocks(book, "interleaved", seed + 10_000 * (n + 1))[0] for n in range(warmups)]
    orders.append(blocks(book, "interleaved", seed)[0])
    chooser = PolicyChooser(policy, prices, seed, without_flags="exclude")
    served = Simulation(chooser, Load.parse(load), orders, seed, max_running=max_running,
                        max_total_tokens=1 << 16).run()
    starts = [0]
    for order in orders:
        starts.append(starts[-1] + len(order))
    return [served[a:b] for a, b in zip(starts, starts[1:])]


def paired_log(first: list, second: list) -> float:
    """Mean over the requests of log(TPOT in ``first`` / TPOT in ``second``)."""
    tpot = {s.index: s.tpot for s in second if s.tpot}
    return statistics.fmean(math.log(s.tpot / tpot[s.index]) for s in first if s.tpot and s.index in tpot)


def cell_table(summary: dict, mine: str, fixed: list[str], loads: list[str], slices: list[str]) -> tuple[int, int]:
    """Print the per slice x load table of ``mine`` against each cell's best fixed arm; (cells met, cells)."""
    print(f"\n## Per slice x load: {mine}'s p50 TPOT and SLO goodput against the cell's best fixed arm\n")
    print("| load | slice | best fixed | p50 TPOT / best (<= 1.03) | goodput / best's (>= 0.97) | p50 TPOT / plain |")
    print("|---|---|---|---|---|---|")
    met = total = 0
    for load in loads:
        for slice_ in slices:
            def p50(name: str) -> float:
                return summary["cells"][f"{name}|{load}"][slice_]["tpot_ms"]["p50"]

            def goodput(name: str) -> float:
                return summary["cells"][f"{name}|{load}"][slice_]["goodput_rps"]

            best = min(fixed, key=p50)
            tp, gp = p50(mine) / p50(best), (goodput(mine) / goodput(best) if goodput(best) else float("nan"))
            vs_plain = p50(mine) / p50("plain")
            ok = tp <= 1.03 and (not goodput(best) or gp >= 0.97) and vs_plain <= 1.0
            met, total = met + ok, total + 1
            print(f"| {load} | {slice_} | {best} | {tp:.3f} | {gp:.3f} | {vs_plain:.3f} |")
    return met, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay_adaptive", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True, help="specgate trace build's output")
    parser.add_argument("--costs", type=Path, required=True, help="specgate trace calibrate's output")
    parser.add_argument("--loads", nargs="+", default=["c1", "c4", "c16", "p0.25", "p0.5"])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 3, 4, 8, 12, 16],
                        help="fixed n-gram draft lengths")
    parser.add_argument("--k-max", type=int, default=16, help="the per-round contenders' largest k")
    parser.add_argument("--max-running-requests", type=int, default=16)
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--policy", type=Path, nargs="*", default=[],
                        help="gateway policy files to replay as contenders (after a warm-up pass)")
    parser.add_argument("--informed", nargs="+", default=[], metavar="FEATURES",
                        help="more informed references, each keyed by these features of a round (joined by +, of "
                             f"{', '.join(FEATURES)}; e.g. request+match): what a predictor from them could reach")
    parser.add_argument("--learning-seeds", type=int, default=10,
                        help="seeds of the three-pass cost-of-learning run of each policy (0: skip it)")
    args = parser.parse_args(argv)

    trace = read_trace(args.trace)
    book = RoundBook(trace)
    prices = Prices(book, load_cost_model(args.costs, revision=trace.header.revision))
    slice_of = {i: r.slice for i, r in enumerate(trace.requests)}.__getitem__
    slices = list(dict.fromkeys(r.slice for r in trace.requests))
    fixed = ["plain", *(f"ngram-k{k}" for k in args.ks)]
    if any(p.draft.kind == "layer_truncated" for p in trace.header.pairs.values()):
        fixed.append("draft-k2")
    common = dict(max_running=args.max_running_requests, max_total_tokens=1 << 16, processes=args.processes)
    arms = {n: parse_arm(n, book) for n in fixed}
    with Progress("fixed arms", None) as bar:
        results = sweep(prices, list(arms.values()), args.loads, args.seeds, "interleaved", progress=bar.reached,
                        **common)
    table = vllm_table(results, fixed, args.loads, args.seeds, slice_of)
    adaptive = [f"ngram-k{args.k_max}-beta", "ngram-k7-sglang", f"ngram-k{args.k_max}-vllm={table}"]
    with Progress("adaptive arms", None) as bar:
        results.update(sweep(prices, [parse_arm(n, book) for n in adaptive], args.loads, args.seeds, "interleaved",
                             progress=bar.reached, **common))
    references = [f"ngram-k{args.k_max}-informed", *(f"ngram-k{args.k_max}-informed={f}" for f in args.informed),
                  f"ngram-k{args.k_max}-oracle"]
    with Progress("references", None) as bar:
        results.update(sweep(prices, [parse_arm(n, book) for n in references], args.loads, args.seeds,
                             "interleaved", progress=bar.reached, **common))
    learning_cost: dict[tuple[str, str], list[float]] = {}
    learned: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for path in args.policy:
        name, policy = f"policy:{path.stem}", load_policy(path)
        adaptive.append(name)
        for load in args.loads:
            for seed in range(args.seeds):
                first, second = warm_policy(prices, policy, load, seed, args.max_running_requests)
                results[(name, load, seed)] = second
                learning_cost.setdefault((name, load), []).append(paired_log(first, second))
                if seed < args.learning_seeds:  # from cold: pass 1, pass 2 (after one pass), measured after two
                    one, two, three = warm_policy(prices, policy, load, seed, args.max_running_requests, warmups=2)
                    during, after = learned.setdefault((name, load), ([], []))
                    during.append(paired_log(one, three))
                    after.append(paired_log(two, three))
    adaptive += [ORACLE, *references]
    for load in args.loads:
        for seed in range(args.seeds):
            results[(ORACLE, load, seed)] = per_request_oracle(results, fixed, load, seed)
    groups = split(results, slice_of)
    names = fixed + adaptive
    summary = summarise(results, names, args.loads, args.seeds, slice_of, slices, SLO)
    mine = adaptive[0]
    print(f"# {args.trace}: {len(trace.requests)} requests, {args.seeds} seeds, costs {args.costs}; "
          f"vLLM table {table}\n")
    print("## Mixed stream: paired geomean TPOT over the best single fixed arm of the load (target <= 0.909)\n")
    print("| load | best fixed (/ plain) | " + " | ".join(adaptive) + " | specgate / plain |")
    print("|---|---|" + "---|" * (len(adaptive) + 1))
    for load in args.loads:
        best = min(fixed, key=lambda n: ratio(groups, n, "plain", load, ALL, args.seeds)["ratio"]
                   if n != "plain" else 1.0)
        over_plain = ratio(groups, best, "plain", load, ALL, args.seeds)["ratio"] if best != "plain" else 1.0
        cells = []
        for name in adaptive:
            r = ratio(groups, name, best, load, ALL, args.seeds)
            cells.append(f"{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}]")
        mp = ratio(groups, mine, "plain", load, ALL, args.seeds)
        print(f"| {load} | {best} ({over_plain:.3f}) | " + " | ".join(cells) + f" | {mp['ratio']:.3f} |")
    for subject in [mine] + [n for n in adaptive if n.startswith("policy:")]:
        met, total = cell_table(summary, subject, fixed, args.loads, slices)
        print(f"\ncells meeting all three: {met}/{total}")
    if "c1" in args.loads:
        print("\n## The worker's plain estimate (what auto learns plain from) against the plain arm, c1, per request\n")
        for arm in ("ngram-k4", mine, "draft-k2"):
            if arm in names:
                mean, sd, n = plain_estimate_error(prices, arm, results[("plain", "c1", 0)], args.max_running_requests)
                print(f"- {arm}: log(estimate / plain) mean {mean:+.4f}, sd {sd:.4f} ({n} requests)")
    print(f"\n## Cost of learning: {mine}, first pass (cold engine) over second (warm), paired geomean TPOT\n")
    for load in ("c1", "c4"):
        r, lo, hi = cold_over_warm(prices, mine, load, min(args.seeds, 10), args.max_running_requests)
        print(f"- {load}: {r:.3f} [{lo:.3f}, {hi:.3f}] ({len(trace.requests)} requests per pass, "
              f"{len(trace.requests) // max(1, len(slices))} per slice)")
    per_slice = len(trace.requests) // max(1, len(slices))
    for (name, load), logs in learning_cost.items():
        mean, lo, hi = interval(logs)
        print(f"- {name} {load}: warm-up pass over measured pass {math.exp(mean):.3f} [{math.exp(lo):.3f}, "
              f"{math.exp(hi):.3f}] (one learner from cold, {per_slice} requests per slice per pass)")
    if learned:
        print(f"\n## The issue's reading: from cold, within 5% of warm after <= 30 requests per slice ({per_slice} "
              f"per slice per pass, {args.learning_seeds} seeds; one learner, three passes in three orders)\n")
        print("| contender | load | pass 1 (requests 1-%d per slice) / pass 3 | pass 2 (after %d per slice) / pass 3 |"
              % (per_slice, per_slice))
        print("|---|---|---|---|")
        for (name, load), (during, after) in learned.items():
            cells = []
            for logs in (during, after):
                mean, lo, hi = interval(logs)
                cells.append(f"{math.exp(mean):.3f} [{math.exp(lo):.3f}, {math.exp(hi):.3f}]")
            print(f"| {name} | {load} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
