"""Timing fidelity of replay: predict a serving-benchmark run's fixed (and per-round) arms and compare, cell by cell.

    python -m bench.replay_fidelity --trace TRACE --costs COSTS [--run docs/runs/full/merged/serve.json.gz]

TRACE must hold the run's requests: ``specgate trace build --per-slice 16
--max-new-tokens 64 --seed 0 --max-prompt-chars 6000 --draft-layers 8`` draws the same seeded sample as
``specgate bench serve --preset full`` (checked here, by id). COSTS is a cost model of this machine
(``specgate trace calibrate``). Each fixed arm of the run is replayed the way the benchmark served it: one
worker with the run's ``--max-running-requests``, one block per slice in the benchmark's order (a run with
``--mix interleaved``: its one seeded stream, in the run's order), the run's loads (closed loop, or Poisson
with the benchmark's own seeded gaps), and p50 TPOT and TTFT per (arm, load, slice) are printed beside the
measured ones (an interleaved run: its ``mixed`` cell, then each request's own slice over all replicates).
The trace of an interleaved run is built with the run's ``--per-slice``, ``--max-tokens`` (as
``--max-new-tokens``), ``--seed`` and ``--max-prompt-chars``: the sample is the same, only its order differs.
The bar: predicted p50 TPOT within +-10% of the measured cell at c1 and within +-20% at
other loads.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
from pathlib import Path

from msgspec import structs

from bench.serve.run import MIXED
from bench.serving_fit import fit, fit_serving_concurrent
from replay.book import RoundBook
from replay.choosers import Prices
from replay.report import percentile
from replay.run import parse_arm, sweep
from replay.sim import Load
from policies.costmodel import load_cost_model
from policies.trace import read_trace

FIXED = ("plain", "ngram-k2", "ngram-k4", "ngram-k8", "suffix", "draft-k2", "draft-k4")
REPO = Path(__file__).resolve().parents[1]


def tolerance(load: str) -> float:
    return 0.10 if load == "c1" else 0.20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay_fidelity", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--costs", type=Path, required=True)
    parser.add_argument("--run", type=Path, default=REPO / "docs/runs/full/merged/serve.json.gz")
    parser.add_argument("--loads", nargs="+", default=None, help="default: the run's")
    parser.add_argument("--arms", nargs="+", default=None, help="default: the run's fixed arms")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--ngram", nargs=3, default=[1, 4, "latest"], metavar=("MIN", "MAX", "MATCH"),
                        help="the run's n-gram rule: docs/runs/full ran at 0c93c07, whose proposer took the latest "
                             "occurrence of n in 1..4 (issue 32 changed it to the earliest, n in 1..12)")
    parser.add_argument("--json", type=Path, default=None, help="write the table as JSON")
    parser.add_argument("--orders", type=int, default=0,
                        help="also replay the arms over this many seeded interleaved orders (specgate replay's "
                             "mix) for the paired ratios")
    parser.add_argument("--fit-serving", action="store_true",
                        help="set the cost model's serving_s (seconds each streamed round adds through the HTTP "
                             "stack) from the run's plain c1 requests alone, then predict every other cell with it")
    parser.add_argument("--fit-serving-concurrent", default=None, metavar="LOAD",
                        help="fit the cost model's serving_concurrent_s (per streamed round when a step streams two "
                             "or more sequences) so replay's plain TPOT p50 at LOAD (e.g. c2) is the run's; every "
                             "other cell stays a prediction")
    parser.add_argument("--fit-serving-streams", nargs="+", default=None, metavar="LOAD",
                        help="fit the cost model's serving_streams table instead: an entry per closed-loop LOAD (c4 "
                             "c16: entries at 4 and 16 streams), in ascending order, so replay's plain TPOT p50 at "
                             "each is the run's; every other cell stays a prediction")
    parser.add_argument("--serving-concurrent-s", type=float, default=None,
                        help="set the cost model's serving_concurrent_s to this (e.g. fitted on another run)")
    parser.add_argument("--serving-s", type=float, default=None,
                        help="set the cost model's serving_s to this (seconds per streamed round), e.g. a value "
                             "fitted with --fit-serving on another run of the same machine")
    args = parser.parse_args(argv)

    run = json.loads(gzip.open(args.run).read() if args.run.suffix == ".gz" else args.run.read_text())
    trace = read_trace(args.trace)
    costs = load_cost_model(args.costs, revision=trace.header.revision)
    order = run_order(run, trace)
    if order is None:
        print("error: the trace does not hold the run's requests in the run's order (per slice); build it with "
              "the command in this module's docstring", file=sys.stderr)
        return 1
    loads = args.loads or run["settings"]["loads"]
    # fixed arms, and the arms whose worker picks k per round (their controller is replayed: walk.py)
    arms = [a for a in (args.arms or run["settings"]["arms"]) if a in FIXED or a.endswith(("-beta", "-sglang"))]
    book = RoundBook(trace, ngram=(int(args.ngram[0]), int(args.ngram[1]), args.ngram[2]))  # type: ignore[arg-type]
    contenders = [parse_arm("suffix-k8" if a == "suffix" else a, book) for a in arms]
    if args.serving_s is not None:
        costs = structs.replace(costs, serving_s=args.serving_s)
    if args.serving_concurrent_s is not None:
        costs = structs.replace(costs, serving_concurrent_s=args.serving_concurrent_s)
    if args.fit_serving:
        costs = fit_serving(run, book, costs)
        if costs is None:
            print("error: --fit-serving: the run has no plain c1 requests to fit serving_s on; give --serving-s "
                  "(fitted on another run of this machine) instead", file=sys.stderr)
            return 2
    if args.fit_serving_concurrent:
        costs = fit_serving_concurrent(run, book, costs, args.fit_serving_concurrent, order)
        if costs is None:
            print(f"error: --fit-serving-concurrent: the run has no plain requests at "
                  f"{args.fit_serving_concurrent}", file=sys.stderr)
            return 2
    if args.fit_serving_streams:
        counts = sorted({Load.parse(label).concurrency or 0 for label in args.fit_serving_streams})
        if counts[0] < 2:
            print("error: --fit-serving-streams: give closed-loop loads of 2 or more clients (c2, c4, c16)",
                  file=sys.stderr)
            return 2
        for count in counts:
            fitted = fit_serving_concurrent(run, book, costs, f"c{count}", order, streams=count)
            if fitted is None:
                print(f"error: --fit-serving-streams: the run has no plain requests at c{count}", file=sys.stderr)
                return 2
            costs = fitted
    prices = Prices(book, costs)
    results = sweep(prices, contenders, loads, 1, "by-slice", max_running=run["settings"]["max_running_requests"],
                    max_total_tokens=65536, processes=args.processes, order=order)
    index = {i: r for i, r in enumerate(trace.requests)}
    rows, inside, total = [], 0, 0
    print("| arm | load | slice | TPOT p50 measured ms | predicted | ratio | within | TTFT p50 measured ms | predicted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arm, contender in zip(arms, contenders):
        for load in loads:
            served = results[(contender.name, load, 0)]
            for slice_, (measured, measured_ttft) in measured_cells(run, arm, load).items():
                mine = [s for s in served if slice_ in (index[s.index].slice, MIXED)]
                tpot = percentile([s.tpot * 1e3 for s in mine if s.tpot], 50)
                ttft = percentile([s.ttft * 1e3 for s in mine], 50)
                ratio = tpot / measured if tpot and measured else None
                ok = ratio is not None and abs(ratio - 1) <= tolerance(load)
                inside += ok
                total += ratio is not None
                rows.append({"arm": arm, "load": load, "slice": slice_, "tpot_measured_ms": measured,
                             "tpot_predicted_ms": tpot, "ratio": ratio, "within": ok,
                             "ttft_measured_ms": measured_ttft, "ttft_predicted_ms": ttft})
                print(f"| {arm} | {load} | {slice_} | {measured:.1f} | {tpot:.1f} | {ratio:.3f} | {'yes' if ok else 'NO'} "
                      f"| {measured_ttft:.0f} | {ttft:.0f} |")
    same: dict[bool, int] = {True: 0, False: 0}  # fixed arms must match exactly; per-round ones need not
    different = dict(same)
    for r in run["requests"]:
        if r["arm"] in arms and r["ok"] and r.get("verify_rounds") is not None and r["load"] in loads:
            i = next(i for i, t in index.items() if t.id == r["item"])
            mine = next(s for s in results[(contenders[arms.index(r["arm"])].name, r["load"], 0)] if s.index == i)
            fixed = r["arm"] in FIXED
            same[fixed] += mine.verify_ct == r["verify_rounds"]
            different[fixed] += mine.verify_ct != r["verify_rounds"]
    print(f"\ntarget forwards per request, replayed vs the run's verify_rounds: fixed arms {same[True]} equal, "
          f"{different[True]} different; per-round arms (their controller samples and learns: not comparable "
          f"request by request) {same[False]} equal, {different[False]} different")
    print(f"{inside} of {total} cells within the bar (+-10% at c1, +-20% elsewhere)")
    for load in loads:
        ratios = [r["ratio"] for r in rows if r["load"] == load and r["ratio"]]
        if ratios:
            print(f"{load}: median predicted/measured {statistics.median(ratios):.3f}, range "
                  f"{min(ratios):.3f}-{max(ratios):.3f}, within {sum(r['within'] for r in rows if r['load'] == load)}"
                  f"/{len(ratios)}")
    relative(rows, loads)
    seeded = None
    if args.orders:  # the same arms over seeded interleaved orders, as specgate replay serves a mix
        seeded = sweep(prices, contenders, loads, args.orders, "interleaved",
                       max_running=run["settings"]["max_running_requests"], max_total_tokens=65536,
                       processes=args.processes)
    paired(run, results, seeded, dict(zip(arms, (c.name for c in contenders))), loads, trace, args.orders)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def run_order(run: dict, trace) -> list[list[int]] | None:
    """The trace indices of the run's requests as the run served them: one block per slice cell in the run's
    order (by-slice), or the one interleaved stream (``--mix interleaved``: cell ``mixed``, each item naming its
    own slice); None unless the trace holds exactly the run's requests, each under the slice the run gave it."""
    where = {(r.slice, r.id): i for i, r in enumerate(trace.requests)}
    if len(where) != len(trace.requests):
        return None
    blocks = [[where.get((w.get("slice", s), w["id"]), -1) for w in items] for s, items in run["workloads"].items()]
    served = [i for block in blocks for i in block]
    if -1 in served or sorted(served) != list(range(len(trace.requests))):
        return None
    if interleaved(run):
        return blocks
    return blocks if all(block == sorted(block) for block in blocks) else None


def interleaved(run: dict) -> bool:
    return run["settings"].get("mix", "by-slice") == "interleaved"


def measured_cells(run: dict, arm: str, load: str) -> dict[str, tuple[float, float]]:
    """(p50 TPOT ms, p50 TTFT ms) measured per slice of one (arm, load): the run's own cells; in an interleaved
    run, the ``mixed`` cell and then each request's own slice (``workload_slice``), over all its replicates."""
    cells = run["arms"][arm]["cells"].get(load, {})
    out = {s: (c["tpot_ms"]["p50"], c["ttft_ms"]["p50"]) for s, c in cells.items()}
    if not interleaved(run) or not cells:
        return out
    by: dict[str, list[dict]] = {}
    for r in run["requests"]:
        if r["arm"] == arm and r["load"] == load and r["ok"]:
            by.setdefault(r["workload_slice"], []).append(r)
    for slice_ in sorted(by):
        mine = by[slice_]
        out[slice_] = (percentile([r["tpot_s"] * 1e3 for r in mine if r["tpot_s"]], 50),
                       percentile([r["ttft_s"] * 1e3 for r in mine], 50))
    return out


def fit_serving(run: dict, book: RoundBook, costs):
    """The cost model with ``serving_s`` = the median, over the run's plain requests at c1, of measured TPOT
    minus the TPOT replayed without it (a plain round commits one token, so the difference is per round;
    ``bench.serving_cost.fit``, which measures the same gap on requests of its own). Only those requests are
    used: every other cell (other arms, other loads) is a prediction."""

    request = {r.id: r for r in book.requests}
    measured = [(len(request[r["item"]].prompt_ids), len(request[r["item"]].output_ids), r["tpot_s"])
                for r in run["requests"]
                if r["arm"] == "plain" and r["load"] == "c1" and r["ok"] and r["tpot_s"] and r["item"] in request]
    if not measured:
        return None
    serving, gaps = fit(costs, measured)
    gaps.sort()
    print(f"serving_s fitted on {len(gaps)} plain c1 requests: {serving * 1e3:.1f} ms per round "
          f"(gaps p10-p90 {1e3 * gaps[len(gaps) // 10]:.1f}-{1e3 * gaps[9 * len(gaps) // 10]:.1f} ms)\n")
    return structs.replace(costs, serving_s=serving)


def relative(rows: list[dict], loads: list[str]) -> None:
    """Each arm's p50 TPOT over plain's in the same (load, slice), predicted beside measured: what a policy
    comparison rests on, free of a factor common to every arm (the machine's speed, or a cost the model
    misses on every round alike)."""
    plain = {(r["load"], r["slice"]): r for r in rows if r["arm"] == "plain"}
    errors: dict[str, list[float]] = {}
    print("\n| arm | load | slice | TPOT / plain measured | predicted | predicted / measured |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        base = plain.get((r["load"], r["slice"]))
        if r["arm"] == "plain" or base is None or not r["tpot_predicted_ms"]:
            continue
        measured = r["tpot_measured_ms"] / base["tpot_measured_ms"]
        predicted = r["tpot_predicted_ms"] / base["tpot_predicted_ms"]
        r["vs_plain_measured"], r["vs_plain_predicted"] = measured, predicted
        errors.setdefault(r["load"], []).append(predicted / measured)
        print(f"| {r['arm']} | {r['load']} | {r['slice']} | {measured:.3f} | {predicted:.3f} | {predicted / measured:.3f} |")
    for load in loads:
        xs = errors.get(load, [])
        if xs:
            inside = sum(abs(x - 1) <= tolerance(load) for x in xs)
            print(f"{load}: ratio to plain, predicted / measured: median {statistics.median(xs):.3f}, range "
                  f"{min(xs):.3f}-{max(xs):.3f}, within the bar {inside}/{len(xs)}")


def paired(run: dict, results: dict, seeded: dict | None, names: dict[str, str], loads: list[str], trace,
           orders: int) -> None:
    """Each arm against plain and each pair of the other arms: geometric mean over requests of their TPOT ratio
    (a request's replicates averaged geometrically first), measured beside replayed in the run's order (and
    over ``orders`` seeded interleaved orders): what a policy comparison in replay rests on."""
    measured: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in run["requests"]:
        if r["ok"] and r["tpot_s"] and r["arm"] in names:
            measured.setdefault((r["arm"], r["load"]), {}).setdefault(r["item"], []).append(math.log(r["tpot_s"]))

    def geomean(a: dict[str, float], b: dict[str, float]) -> float | None:
        xs = [a[i] - b[i] for i in a if i in b]
        return math.exp(sum(xs) / len(xs)) if xs else None

    def replayed(served) -> dict[str, float]:
        return {trace.requests[s.index].id: math.log(s.tpot) for s in served if s.tpot}

    arms = list(names)
    pairs = [(a, "plain") for a in arms if a != "plain" and "plain" in names]
    pairs += [(a, b) for i, a in enumerate(arms) for b in arms[i + 1:] if "plain" not in (a, b)]
    print("\n| load | pair | measured (paired geomean TPOT) | replayed, the run's order |"
          + (f" replayed, {orders} seeded orders |" if seeded else ""))
    print("|---|---|---|---|" + ("---|" if seeded else ""))
    for load in loads:
        for a, b in pairs:
            mine = {arm: {i: sum(v) / len(v) for i, v in measured.get((arm, load), {}).items()} for arm in (a, b)}
            real = geomean(mine[a], mine[b])
            ours = geomean(replayed(results[(names[a], load, 0)]), replayed(results[(names[b], load, 0)]))
            if real is None or ours is None:
                continue
            line = f"| {load} | {a} / {b} | {real:.3f} | {ours:.3f} |"
            if seeded:
                logs = [math.log(geomean(replayed(seeded[(names[a], load, s)]), replayed(seeded[(names[b], load, s)])))
                        for s in range(orders)]
                line += f" {math.exp(sum(logs) / len(logs)):.3f} |"
            print(line)


if __name__ == "__main__":
    sys.exit(main())
