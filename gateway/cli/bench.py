"""`specgate bench serve`: the serving benchmark (``bench/serve``): every arm's policy on a fresh worker
and gateway, the same seeded workload requests, closed-loop and Poisson load; JSON, markdown and PNGs."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (serve: adaptive vs fixed speculation through the gateway)",
                       description=__doc__.split("\n")[0])
    kinds = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    serve = kinds.add_parser("serve", help="serving benchmark through the gateway",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                             description="Adaptive speculation vs every fixed configuration, per slice and load "
                                         "point, through the gateway (docs/benchmarks.md, 'Serving benchmark').")
    from bench.serve.cli import add_arguments

    add_arguments(serve)
    serve.set_defaults(func=_run)
    reliability = kinds.add_parser("reliability", help="soak, faults, disconnects, overload, reloads",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                   description="Reliability run through the gateway to two real workers "
                                               "(docs/reliability.md).")
    from bench.reliability import add_arguments as reliability_arguments
    from bench.reliability import run as run_reliability

    reliability_arguments(reliability)
    reliability.set_defaults(func=run_reliability)


def _run(args: argparse.Namespace) -> int:
    from bench.serve.cli import run_cli

    argv = sys.argv[sys.argv.index("serve") + 1:] if "serve" in sys.argv else []
    return run_cli(args, argv)
