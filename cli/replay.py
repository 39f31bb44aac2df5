"""`specgate replay`: policies and fixed arms on a recorded trace, simulated (docs/replay.md).

Exit codes: 0 done; 1 the input cannot be replayed (trace, cost model, policy, arms); 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

DEFAULT_ARMS = ("plain", "ngram-k2", "ngram-k4", "ngram-k8", "suffix-k8", "draft-k2", "draft-k4")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "replay", help="try policies and fixed arms on a recorded trace (simulated, exact acceptance)",
        description="Replay a trace (specgate trace build, or the gateway's recording) under each --policy and "
                    "each fixed --arm at each load: per-round acceptance from exact greedy counterfactuals, time "
                    "from a cost model (specgate trace calibrate), the gateway's real decide() and learner on a "
                    "simulated clock, the embedded worker's scheduling. Prints per load and slice TPOT/TTFT "
                    "percentiles, tok/s, SLO goodput, accept length and decisions, and paired TPOT ratios with "
                    "95%% intervals over seeds.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--trace", type=Path, required=True, help="the trace (JSON Lines, docs/replay.md)")
    parser.add_argument("--costs", action="append", required=True, metavar="[WORKER=]FILE|URL",
                        help="cost model (specgate trace calibrate), or a running specgate worker's URL (its live "
                             "step costs); WORKER=... for one worker URL of a policy (repeatable), a bare one for "
                             "every other worker")
    parser.add_argument("--policy", type=Path, action="append", default=[], help="a policy file (repeatable)")
    parser.add_argument("--arms", nargs="*", default=None,
                        help=f"fixed arms: plain, ngram-kN, suffix-kN, draft-kN, draftL-kN (default: "
                             f"{' '.join(DEFAULT_ARMS)}, those the trace can replay)")
    parser.add_argument("--loads", nargs="+", default=["c1", "c4", "c16"],
                        help="cN closed-loop clients, pR Poisson arrivals per second, trace: recorded times")
    parser.add_argument("--seeds", type=int, default=10, help="seeds per load (order, arrivals, exploration)")
    parser.add_argument("--mix", choices=("interleaved", "by-slice"), default="interleaved",
                        help="one stream of every slice (a front door), or one block per slice label")
    parser.add_argument("--ngram", nargs=3, default=None, metavar=("MIN", "MAX", "MATCH"),
                        help="the workers' n-gram settings (--speculative-ngram-min/max-match-window-size, "
                             "--speculative-ngram-match); default the worker's: 1 12 earliest")
    parser.add_argument("--max-running-requests", type=int, default=16, help="the worker's (specgate worker's default)")
    parser.add_argument("--max-total-tokens", type=int, default=65536, help="the worker's KV capacity")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="the worker's --chunked-prefill-size: prompt tokens one request feeds per step (default "
                             "256; a larger one than the cost model's prefill grid holds is refused)")
    parser.add_argument("--max-batch-tokens", type=int, default=512,
                        help="the worker's --max-batch-tokens: tokens one step feeds, rounds first, then prefill")
    parser.add_argument("--context-length", type=int, default=8192, help="the model's context window")
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="default: the first policy's, else 2000")
    parser.add_argument("--slo-tpot-ms", type=float, default=None, help="default: the first policy's, else 150")
    parser.add_argument("--processes", type=int, default=None, help="simulation processes (default: the CPUs)")
    parser.add_argument("--out", type=Path, default=None, help="directory for replay.json, replay.md and plots")
    parser.set_defaults(func=_replay)


def _fail(message: str, code: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _replay(args: argparse.Namespace) -> int:
    from replay.book import RoundBook  # replay loads when the subcommand runs (about 0.1 s more on specgate --help)
    from replay.choosers import Prices  # see above
    from replay.report import comparisons, markdown, plots, summarise  # see above
    from replay.run import Contender, load_policy, parse_arm, sweep  # see above
    from replay.sim import Load  # see above
    from cli.costs import load_costs  # see above
    from policies.costmodel import CostModelError  # see above
    from policies.trace import TraceError, read_trace  # see above

    chunk_given = args.prefill_chunk is not None
    args.prefill_chunk = args.prefill_chunk if chunk_given else 256
    if min(args.seeds, args.max_running_requests, args.prefill_chunk, args.max_batch_tokens) < 1:
        return _fail("--seeds, --max-running-requests, --prefill-chunk and --max-batch-tokens must be at least 1", 2)
    try:
        for label in args.loads:
            Load.parse(label)
    except ValueError as exc:
        return _fail(str(exc), 2)
    try:
        trace = read_trace(args.trace)
        revision = trace.header.revision
        default, per_worker = None, {}
        for spec in args.costs:
            worker, _, path = spec.rpartition("=") if "=" in spec and not Path(spec).exists() else ("", "", spec)
            model = load_costs(path, revision=revision)
            if worker:
                per_worker[worker] = model
            else:
                default = model
        if default is None:
            default = next(iter(per_worker.values()))
        book = RoundBook(trace, ngram=(int(args.ngram[0]), int(args.ngram[1]), args.ngram[2]) if args.ngram else None)
        contenders: list[Contender] = []
        policies = []
        for path in args.policy:
            policy = load_policy(path)
            _check_pairs(policy, revision, path)
            contenders.append(Contender(path.stem, policy=policy, path=str(path)))
            policies.append(path.stem)
        arms = args.arms if args.arms is not None else _available(book)
        contenders = [parse_arm(name, book) for name in dict.fromkeys(arms)] + contenders
    except (TraceError, CostModelError, ValueError, OSError) as exc:
        return _fail(str(exc))
    if len({c.name for c in contenders}) != len(contenders):
        return _fail("two contenders share a name (policy files are named by their stem); rename one", 2)
    if not contenders:
        return _fail("nothing to replay: give --policy or --arms", 2)
    if not any(r.output_ids for r in trace.requests):
        return _fail(f"{args.trace}: no request with output tokens to replay")

    first = next((c.policy for c in contenders if c.is_policy), None)
    slo_default = first.slo if first is not None else None
    slo_ms = (args.slo_ttft_ms or (slo_default.ttft_ms if slo_default and slo_default.ttft_ms else 2000.0),
              args.slo_tpot_ms or (slo_default.tpot_ms if slo_default and slo_default.tpot_ms else 150.0))
    largest = min(model.prefill.tokens[-1] for model in (default, *per_worker.values()))
    if chunk_given and args.prefill_chunk > largest:
        return _fail(f"--prefill-chunk {args.prefill_chunk}: the cost model's prefill grid ends at {largest} tokens, "
                     "and a chunk beyond it would be priced by extrapolation, which no measurement backs; "
                     f"calibrate with `specgate trace calibrate --prefill-tokens 16 64 256 {args.prefill_chunk}` and "
                     f"replay with that file, or replay with --prefill-chunk {largest}", 2)
    prices = Prices(book, default, args.prefill_chunk, args.context_length, per_worker, args.max_batch_tokens)
    names = [c.name for c in contenders]
    processes = args.processes or os.cpu_count() or 1
    started = time.perf_counter()

    from telemetry.progress import Progress  # about 0.05 s: only a run shows progress

    with Progress("replay runs", None) as bar:
        try:
            results = sweep(prices, contenders, args.loads, args.seeds, args.mix,
                            max_running=args.max_running_requests, max_total_tokens=args.max_total_tokens,
                            processes=processes, progress=bar.reached)
        except ValueError as exc:
            return _fail(str(exc))
    slices = list(dict.fromkeys(r.slice for r in trace.requests if r.output_ids))
    slice_of = {i: r.slice for i, r in enumerate(trace.requests)}.__getitem__
    summary = summarise(results, names, args.loads, args.seeds, slice_of, slices,
                        (slo_ms[0] / 1e3, slo_ms[1] / 1e3), comparisons(names, policies))
    meta = {"trace": str(args.trace), "requests": sum(1 for r in trace.requests if r.output_ids),
            "estimated": sum(1 for r in trace.requests if not r.sampling.greedy), "mix": args.mix,
            "seeds": args.seeds, "costs": " ".join(args.costs), "slo_ms": slo_ms,
            "command": "specgate " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["replay"] else "",
            "wall_s": round(time.perf_counter() - started, 1), "runs": len(results)}
    drawn: list[Path] = []
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        drawn = plots(summary, names, args.loads, slices, args.out)
    text = markdown(summary, meta, names, args.loads, slices, drawn)
    print(text)
    if args.out is not None:
        (args.out / "replay.md").write_text(text, encoding="utf-8")
        (args.out / "replay.json").write_text(json.dumps({"meta": meta, "settings": _settings(args), **summary},
                                                         indent=1, default=str), encoding="utf-8")
        print(f"wrote {args.out}/replay.md, replay.json" + (f" and {len(drawn)} plots" if drawn else
                                                           " (no plots: matplotlib is not installed)"),
              file=sys.stderr)
    print(f"replay: {meta['runs']} runs in {meta['wall_s']} s", file=sys.stderr)
    return 0


def _available(book) -> list[str]:
    """The default arms the trace can replay (draft arms need exactly one self-draft pair)."""
    drafts = [p for p in book.trace.header.pairs.values() if p.draft.kind == "layer_truncated"]
    return [a for a in DEFAULT_ARMS if not a.startswith("draft") or len(drafts) == 1]


def _check_pairs(policy, revision: str, path: Path) -> None:
    """A policy whose pairs target another model revision than the trace's cannot be replayed on it."""
    for name, pair in policy.pairs.items():
        if pair.target.revision not in (None, revision):
            raise ValueError(f"--policy {path}: pair {name} targets revision {pair.target.revision}, but the trace "
                             f"was recorded on {revision}; replay a trace of that model")


def _settings(args: argparse.Namespace) -> dict:
    return {k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if isinstance(v, list) else v)
            for k, v in vars(args).items() if k != "func"}
