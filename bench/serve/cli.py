"""Flags of ``specgate bench serve`` / ``python -m bench.serve`` and the entry point."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from bench.serve.arms import ARMS
from bench.serve.misses import report
from bench.serve.presets import PRESETS
from bench.workloads import DEFAULT_ROOT, SLICES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=("default", "full"), default="default",
                   help="sizes: default ~36-40 min, full (the issue's arms and loads, 16 requests per slice, "
                        "64 tokens) ~2.2 h per load point (--loads c1, ...; merge the parts with --merge) on a "
                        "quiet 2-core machine; any size flag given explicitly overrides the preset")
    p.add_argument("--workloads", type=Path, default=DEFAULT_ROOT, help="a full copy of the workload sets (default: $SPECGATE_WORKLOADS, else the sample in workloads/)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), metavar="ARM", help=f"of {', '.join(ARMS)}")
    p.add_argument("--slices", nargs="+", default=list(SLICES), choices=SLICES, metavar="SLICE")
    p.add_argument("--per-slice", type=int, default=None, help="requests per slice (same for every arm)")
    p.add_argument("--mix", choices=("by-slice", "interleaved"), default="by-slice",
                   help="by-slice: a cell per load point and slice, the slices served in turn; interleaved: one "
                        "cell per load point, slice \"mixed\", every slice's requests in one seeded order, as a "
                        "front door serves them (each request keeps its own slice as workload_slice)")
    p.add_argument("--repeats", type=int, default=1,
                   help="every arm serves every cell this many times (same requests, same arrivals): replicates "
                        "measure the noise between two runs of one configuration, and the paired intervals "
                        "average them; time scales with it (1 with warm arms: their tree keeps every cell's answers)")
    p.add_argument("--max-tokens", type=int, default=None, help="max_tokens of every request")
    p.add_argument("--loads", nargs="+", default=None, metavar="LOAD",
                   help="cN = closed loop with N clients, pR = Poisson arrivals at R requests/s")
    p.add_argument("--warmup-per-slice", type=int, default=None,
                   help="warm-up requests per slice for adaptive-warm (disjoint from the measured ones)")
    p.add_argument("--warmup-concurrency", type=int, default=1, help="closed-loop clients in the warm-up")
    p.add_argument("--max-prompt-chars", type=int, default=6000,
                   help="longer prompts are middle-truncated (recorded); must fit the context window")
    p.add_argument("--seed", type=int, default=0, help="request sample, warm-up order and Poisson arrivals")
    p.add_argument("--max-running-requests", type=int, default=8, help="the worker's batch size")
    p.add_argument("--num-threads", type=int, default=None, help="the worker's torch threads")
    p.add_argument("--restart", choices=("worker", "gateway"), default="gateway",
                   help="what starts fresh for every arm: only the gateway (learner), all gateways in front of "
                        "one shared worker (default: every arm is timed on the same process, as the default "
                        "policy's pools share one worker), or also a worker per arm")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", type=Path, default=Path("results/serve"), help="directory for JSON, markdown, PNGs, logs")
    p.add_argument("--keep-progress", action="store_true", help="leave the progress bar on screen at the end")
    p.add_argument("--report", type=Path, default=None, metavar="DIR",
                   help="run nothing: re-render DIR/serve.md and the plots from DIR/serve.json (or serve.json.gz)")
    p.add_argument("--misses", type=Path, default=None, metavar="RUN",
                   help="run nothing: RUN's (serve.json or serve.json.gz) SLO misses by cause (TTFT, TPOT, both) per "
                        "arm, load and slice, and the TTFT misses with another prompt of the cell waiting alongside "
                        "(the arms of --arms when given, else every arm of the run)")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="DIR",
                   help="run nothing: join the results of one command run per load point (e.g. --preset full "
                        "--loads c1, then --loads c4; each DIR with serve.json or serve.json.gz) into --out's "
                        "serve.json, report and plots")


def apply_preset(args: argparse.Namespace) -> argparse.Namespace:
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("per_slice", "repeats", "max_tokens", "warmup_per_slice", "warmup_concurrency", "max_running_requests"):
        if getattr(args, key) < (0 if key == "warmup_per_slice" else 1):
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1 (got {getattr(args, key)})")
    return args


def register(kinds: argparse._SubParsersAction) -> None:
    """``specgate bench serve`` (the ``specgate.bench`` entry point, pyproject.toml)."""
    p = kinds.add_parser("serve", help="serving benchmark through the gateway",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         description="Adaptive speculation vs every fixed configuration, per slice and load "
                                     "point, through the gateway (docs/benchmarks.md, 'Serving benchmark').")
    add_arguments(p)
    p.set_defaults(func=lambda args: run_cli(args, sys.argv[sys.argv.index("serve") + 1:]
                                              if "serve" in sys.argv else []))


def run_cli(args: argparse.Namespace, argv: list[str]) -> int:
    from bench.serve.run import run, write  # about 0.1 s: specgate --help loads this module

    if args.report is not None:
        return _rerender(args.report)
    if args.misses is not None:
        return report(args.misses, None if args.arms == list(ARMS) else args.arms)
    if args.merge is not None:
        return _merge(args.merge, args.out)
    # while it runs, SIGTERM unwinds like Ctrl-C, so workers and gateways are stopped; the caller's handler
    # comes back after (a test that runs this in-process must not leave its handler to later forks)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        args = apply_preset(args)
        result = run(args, argv)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a worker or gateway that did not start
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    json_path, md_path, pngs = write(result, args.out)
    print(md_path.read_text())
    print(f"wrote {json_path}, {md_path}, " + ", ".join(str(p) for p in pngs))
    return 0


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _rerender(out: Path) -> int:
    from bench.serve.run import read, write  # about 0.1 s: specgate --help loads this module

    try:
        result = read(out)
    except ValueError as exc:
        print(f"error: --report {exc}", file=sys.stderr)
        return 2
    json_path, md_path, pngs = write(result, out, rewrite_json=False)
    print(f"wrote {md_path}, " + ", ".join(str(p) for p in pngs))
    return 0


def _merge(dirs: list[Path], out: Path) -> int:
    from bench.serve.merge import load_parts, merge  # about 0.1 s (it imports bench.serve.run): as above
    from bench.serve.run import write  # see above

    try:
        if out.resolve() in {d.resolve() for d in dirs}:
            raise ValueError(f"--out {out} is one of the merged directories; give a new one")
        result = merge(load_parts(dirs), [str(d) for d in dirs])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path, pngs = write(result, out)
    print(f"wrote {json_path}, {md_path}, " + ", ".join(str(p) for p in pngs))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv), argv)
