"""A serving run's arrivals on the embedded engine alone, beside replay's prediction (timing fidelity).

    python -m bench.engine_arrivals --trace TRACE --costs COSTS --run serve.json.gz [--loads c1 p0.25] [--arms plain]

Replay under-predicts the TPOT of Poisson cells of ``bench serve`` (docs/replay.md, "A mixed stream"). This
separates the engine from the serving path around it: the run's requests (the trace's prompt ids, in the run's
order) are submitted to one in-process ``Engine`` (no HTTP, no gateway, no client) at the arrival times
``bench serve`` and replay both draw for the load (closed loop for ``cN``), and the engine is stepped on this
thread, sleeping only while it holds nothing. Each request's TPOT is the engine's own (submit to last token,
less its first token, over the tokens after the first), and the replay of the same requests, load and order
is priced without ``serving_s`` (the cost model's engine alone). If the engine alone meets replay at a load
where the served run does not, the missing time is in the serving path under that load, not in the engine's
steps.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
import time
from pathlib import Path

from bench.replay_fidelity import run_order
from replay.sim import Load


def arrivals(load: Load, count: int, seed: int) -> list[float] | None:
    """Offsets (s) of ``count`` arrivals of Poisson ``load``, as bench serve and replay draw them
    (``Load.arrivals``); None for a closed loop."""
    return None if load.rate is None else load.arrivals(count, seed)


def request(r, rid: str, spec, max_new: int):
    """The engine's request for trace request ``r``: its prompt ids, greedy, ``max_new`` tokens at most."""
    from backends.engine.types import GenerateRequest, SamplingParams

    return GenerateRequest(rid=rid, input_ids=tuple(r.prompt_ids), speculation=spec,
                           sampling=SamplingParams(max_new_tokens=max_new, temperature=0.0))


def serve(engine, requests: list, load: Load, seed: int, spec) -> list[float | None]:
    """Each request's engine TPOT (s) under ``load``, in order: Poisson at :func:`arrivals`' offsets, or
    ``load.concurrency`` in flight (the next submitted as one finishes)."""
    times = arrivals(load, len(requests), seed)
    finished: dict[int, object] = {}
    submitted = 0

    def submit(i: int) -> None:
        r = requests[i]
        engine.submit(request(r, f"{load.label}-{i}-{time.monotonic_ns()}", spec, r.sampling.max_new_tokens),
                      lambda out, i=i: finished.__setitem__(i, out) if out.finished else None)

    start = time.perf_counter()
    while len(finished) < len(requests):
        now = time.perf_counter() - start
        if times is None:
            while submitted < len(requests) and submitted - len(finished) < load.concurrency:
                submit(submitted)
                submitted += 1
        else:
            while submitted < len(requests) and times[submitted] <= now:
                submit(submitted)
                submitted += 1
        if not engine.step() and times is not None and submitted < len(requests):
            time.sleep(max(0.0, times[submitted] - (time.perf_counter() - start)))
    out = []
    for i in range(len(requests)):
        stats, tokens = finished[i].stats, len(finished[i].output_ids)
        ok = stats.e2e_s is not None and stats.first_token_s is not None and tokens > 1
        out.append((stats.e2e_s - stats.first_token_s) / (tokens - 1) if ok else None)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_arrivals", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True, help="the run's requests (replay_fidelity's trace)")
    parser.add_argument("--costs", type=Path, required=True, help="this machine's cost model (trace calibrate)")
    parser.add_argument("--run", type=Path, required=True, help="a bench serve --mix interleaved run: its order")
    parser.add_argument("--loads", nargs="+", default=["c1", "p0.25"])
    parser.add_argument("--arms", nargs="+", default=["plain"])
    args = parser.parse_args(argv)

    from msgspec import structs

    from backends.engine.config import EngineConfig
    from backends.engine.engine import Engine
    from backends.engine.model_store import load_prepared
    from bench.engine import ENGINE_ARMS
    from replay.book import RoundBook
    from replay.choosers import Prices
    from replay.run import parse_arm, sweep
    from policies.costmodel import load_cost_model
    from policies.trace import read_trace

    run = json.loads(gzip.open(args.run).read() if args.run.suffix == ".gz" else args.run.read_text())
    trace = read_trace(args.trace)
    order = run_order(run, trace)
    if order is None or len(order) != 1:
        print("error: --run must be an interleaved run (bench serve --mix interleaved) of exactly the trace's "
              "requests", file=sys.stderr)
        return 1
    loads = [Load.parse(text) for text in args.loads]
    seed = run["settings"]["seed"]
    costs = structs.replace(load_cost_model(args.costs, revision=trace.header.revision), serving_s=0.0)
    book = RoundBook(trace, ngram=(1, 12, "earliest"))
    unknown = [arm for arm in args.arms if f"engine-{arm}" not in ENGINE_ARMS]
    if unknown:
        print(f"error: --arms: {', '.join(unknown)}: use plain or ngram-k2/k4/k8", file=sys.stderr)
        return 2
    contenders = [parse_arm(arm, book) for arm in args.arms]
    predicted = sweep(Prices(book, costs), contenders, args.loads, 1, "by-slice", max_running=16,
                      max_total_tokens=65536, processes=1, order=order)
    requests = [trace.requests[i] for i in order[0]]
    prepared = load_prepared()
    engine = Engine(EngineConfig(model_path=str(prepared.path), dtype="float32", max_running_requests=16))
    engine.generate(request(requests[0], "warm-up", ENGINE_ARMS["engine-plain"], 4))  # warm-up, not counted
    print(f"{len(requests)} requests in the run's order; engine TPOT in process, replay without serving_s")
    print("| arm | load | requests | engine TPOT p50 ms | replayed p50 ms | replayed / engine, p50 | geomean [95%] |")
    print("|---|---|---|---|---|---|---|")
    for arm, contender in zip(args.arms, contenders):
        spec = ENGINE_ARMS[f"engine-{arm}"]
        for load in loads:
            measured = serve(engine, requests, load, seed, spec)
            replayed = {s.index: s.tpot for s in predicted[(contender.name, load.label, 0)]}
            pairs = [(m, replayed[i]) for m, i in zip(measured, order[0]) if m and replayed.get(i)]
            logs = [math.log(p / m) for m, p in pairs]
            mean, half = statistics.fmean(logs), 1.96 * statistics.stdev(logs) / math.sqrt(len(logs))
            p50m, p50p = statistics.median(m for m, _ in pairs), statistics.median(p for _, p in pairs)
            print(f"| {arm} | {load.label} | {len(pairs)} | {p50m * 1e3:.1f} | {p50p * 1e3:.1f} | {p50p / p50m:.3f} | "
                  f"{math.exp(mean):.3f} [{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}] |", flush=True)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
