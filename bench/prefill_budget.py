"""The engine's prefill budget per step, side by side in one process: which prompts a step's prefill feeds,
in which order, and whether ``--chunked-prefill-size`` is each prompt's chunk or the step's in all (the
earlier rule, a chunk per prompt in admission order, is kept here as the reference).

    .venv/bin/python -m bench.prefill_budget --loads c4 --repeats 3

One real-model engine per rule (the same weights), closed loop on the mixed workload (``--per-slice`` prompts
of every slice, one slice after another in turn; ``specgate bench serve --mix interleaved`` shuffles), greedy,
``--max-new-tokens`` each; per load and arm the rules run back to back, their order alternating per repeat so
drift falls on all, after one unmeasured pass of every prompt on each engine (a fresh engine's first cell runs
several times slower than the others). Times are the engine's own (submission to first token, first token to last), no HTTP.
Prints per rule the TTFT and TPOT percentiles, requests within the SLO (the default policy's, 2000 / 150 ms)
and wall time, over all repeats and per slice.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections import deque
from dataclasses import dataclass

from backends.engine.engine import Engine
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from bench.workloads import DEFAULT_ROOT

ARMS = {"plain": SpeculationParams(), "ngram-k4": SpeculationParams(proposer="ngram", draft_tokens=4),
        "ngram-k16-beta": SpeculationParams(proposer="ngram", draft_tokens=16, adaptive=True, strategy="beta")}
# rules: the order of the prefilling prompts (shortest remaining first, or admission order) and whether
# prefill_chunk is each prompt's chunk or the step's prefill budget in all (shared)
RULES = ("shortest-per-prompt", "per-prompt", "shortest-shared", "first-come-shared")
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.150


class AdmissionOrder(Engine):
    """The engine's earlier rule: a chunk per prompt as the engine's, the prompts in admission order."""

    @staticmethod
    def _prefill_order(prefilling):
        return prefilling


class SharedBudget(Engine):
    """``prefill_chunk`` is the step's prefill budget, all prompts together (as SGLang's
    ``--chunked-prefill-size``), the shortest remaining prompt first."""

    def _plan_prefills(self, running, left):
        # the engine caps each prompt at min(what is left, prefill_chunk): with what is left already at most
        # prefill_chunk, the cap is what is left, shared by the step's prompts
        return super()._plan_prefills(running, min(left, self.config.prefill_chunk))


class FirstComeShared(SharedBudget):
    """The shared budget to the earliest admitted prompt first (SGLang's default ``fcfs`` order)."""

    _prefill_order = staticmethod(AdmissionOrder._prefill_order)


@dataclass(frozen=True)
class Served:
    slice: str
    ttft_s: float
    tpot_s: float

    @property
    def met(self) -> bool:
        return self.ttft_s <= SLO_TTFT_S and self.tpot_s <= SLO_TPOT_S


def interleaved(items, render, tokenizer) -> list[tuple[str, list[int]]]:
    """(slice, prompt ids), one prompt of every slice in turn."""
    by_slice: dict[str, list] = {}
    for item in items:
        by_slice.setdefault(item.slice, []).append(item)
    return [(item.slice, render(tokenizer, item)) for group in itertools.zip_longest(*by_slice.values())
            for item in group if item is not None]


def closed_loop(engine: Engine, prompts, spec: SpeculationParams, clients: int, requests: int, max_new: int,
                tag: str) -> tuple[float, list[Served]]:
    """``requests`` requests (the prompts in order, cycled), ``clients`` in flight; (wall seconds, each served)."""
    queue = deque(range(requests))
    submitted, first, last, tokens = {}, {}, {}, {}

    def submit() -> None:
        i = queue.popleft()
        submitted[i] = time.perf_counter()

        def on_output(out, i=i) -> None:
            now = time.perf_counter()
            if out.output_ids:
                first.setdefault(i, now)
            if out.finished:
                last[i], tokens[i] = now, len(out.output_ids)

        engine.submit(GenerateRequest(rid=f"{tag}-{i}", input_ids=tuple(prompts[i % len(prompts)][1]),
                                      speculation=spec,
                                      sampling=SamplingParams(max_new_tokens=max_new, temperature=0.0)), on_output)

    start = time.perf_counter()
    for _ in range(min(clients, requests)):
        submit()
    while len(last) < requests:
        engine.step()
        while queue and (requests - len(queue)) - len(last) < clients:
            submit()
    wall = time.perf_counter() - start
    return wall, [Served(prompts[i % len(prompts)][0], first[i] - submitted[i],
                         (last[i] - first[i]) / max(1, tokens[i] - 1)) for i in range(requests)]


def summary(served: list[Served]) -> str:
    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] * 1e3

    ttft, tpot = [s.ttft_s for s in served], [s.tpot_s for s in served]
    return (f"{pct(ttft, 0.5):.0f} / {pct(ttft, 0.9):.0f} | {pct(tpot, 0.5):.1f} / {pct(tpot, 0.9):.1f} | "
            f"{sum(s.met for s in served)}/{len(served)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefill_budget", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=str(DEFAULT_ROOT),
                        help="a full copy of the workload sets (default: $SPECGATE_WORKLOADS, else the sample in workloads/)")
    parser.add_argument("--loads", nargs="+", default=["c4"], help="closed-loop clients, cN")
    parser.add_argument("--arms", nargs="+", default=["ngram-k4", "plain"], choices=sorted(ARMS))
    parser.add_argument("--rules", nargs="+", default=list(RULES[:3]), choices=RULES,
                        help="shortest-per-prompt (the engine's), per-prompt (before 2026-12-05), shortest-shared, "
                             "first-come-shared")
    parser.add_argument("--per-slice", type=int, default=4, help="prompts per slice")
    parser.add_argument("--requests", type=int, default=0, help="requests per cell (default: one per prompt)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-chunk", type=int, default=256, help="the engine's --chunked-prefill-size")
    args = parser.parse_args(argv)
    clients = []
    for load in args.loads:
        if not (load.startswith("c") and load[1:].isdigit() and int(load[1:]) >= 1):
            parser.error(f"--loads {load!r}: closed-loop loads only, cN with N >= 1 (e.g. c4)")
        clients.append(int(load[1:]))
    if min(args.per_slice, args.max_new_tokens, args.repeats, args.prefill_chunk) < 1 or args.requests < 0:
        parser.error("--per-slice, --max-new-tokens, --repeats and --prefill-chunk must be at least 1, "
                     "--requests at least 0")
    return run(args, clients)


def run(args, clients: list[int]) -> int:
    from backends.engine.config import EngineConfig
    from backends.engine.model_store import load_prepared
    from backends.engine.runner import load_model
    from bench.engine import render
    from replay.workloads import sample

    prepared = load_prepared()
    model = load_model(str(prepared.path), "float32")
    config = EngineConfig(model_path=str(prepared.path), dtype="float32", max_running_requests=max(16, *clients),
                          prefill_chunk=args.prefill_chunk)
    kinds = {"shortest-per-prompt": Engine, "per-prompt": AdmissionOrder, "shortest-shared": SharedBudget,
             "first-come-shared": FirstComeShared}
    engines = {rule: kinds[rule](config, model=model) for rule in args.rules}
    prompts = interleaved(sample(args.workloads, args.per_slice, 0, 6000), render, engines[args.rules[0]].tokenizer)
    requests = args.requests or len(prompts)
    print(f"command: python -m bench.prefill_budget {' '.join(argv_of(args))}")
    print(f"{len(prompts)} prompts ({min(len(p) for _, p in prompts)}-{max(len(p) for _, p in prompts)} tokens), "
          f"{requests} requests per cell, max_new_tokens {args.max_new_tokens}, SLO TTFT <= {SLO_TTFT_S * 1e3:.0f} "
          f"ms and TPOT <= {SLO_TPOT_S * 1e3:.0f} ms; date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for rule, engine in engines.items():  # each engine's first steps pay its one-off costs: not measured
        closed_loop(engine, prompts, ARMS[args.arms[0]], max(clients), len(prompts), 8, f"warm-up-{rule}")
    cells: dict[tuple[int, str, str], list[Served]] = {}
    walls: dict[tuple[int, str, str], float] = {}
    for c in clients:
        for repeat in range(args.repeats):
            for arm in args.arms:
                order = args.rules if repeat % 2 == 0 else list(reversed(args.rules))
                for rule in order:
                    wall, served = closed_loop(engines[rule], prompts, ARMS[arm], c, requests, args.max_new_tokens,
                                               f"{rule}-{arm}-c{c}-{repeat}")
                    cells.setdefault((c, arm, rule), []).extend(served)
                    walls[(c, arm, rule)] = walls.get((c, arm, rule), 0.0) + wall
                    print(f"c{c} {arm} {rule} repeat {repeat}: {summary(served)} | wall {wall:.1f} s", flush=True)
    print("\n| load | arm | rule | slice | TTFT p50 / p90 ms | TPOT p50 / p90 ms | within SLO | wall s |")
    print("|---|---|---|---|---|---|---|---:|")
    for (c, arm, rule), served in cells.items():
        print(f"| c{c} | {arm} | {rule} | all | {summary(served)} | {walls[(c, arm, rule)]:.1f} |")
        for slice_ in sorted({s.slice for s in served}):
            print(f"| c{c} | {arm} | {rule} | {slice_} | {summary([s for s in served if s.slice == slice_])} | |")
    for engine in engines.values():
        engine.shutdown()
    return 0


def argv_of(args) -> list[str]:
    return ["--workloads", args.workloads, "--loads", *args.loads, "--arms", *args.arms, "--rules", *args.rules,
            "--per-slice", str(args.per_slice), "--requests", str(args.requests), "--max-new-tokens",
            str(args.max_new_tokens), "--repeats", str(args.repeats), "--prefill-chunk", str(args.prefill_chunk)]


if __name__ == "__main__":
    raise SystemExit(main())
