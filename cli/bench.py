"""`specgate bench NAME`: the benchmarks installed with specgate, found through the ``specgate.bench`` entry
points (pyproject.toml), so the product never imports its benchmarks by name (docs/architecture.md, "Parts and layers").

Each entry point names a function ``register(subparsers)`` that adds its benchmark's parser and sets
``func``; ``specgate bench --help`` lists whatever is installed.
"""

from __future__ import annotations

import argparse
from importlib.metadata import entry_points

GROUP = "specgate.bench"


def register(sub: argparse._SubParsersAction) -> None:
    found = sorted(entry_points(group=GROUP), key=lambda ep: ep.name)
    p = sub.add_parser("bench", help=f"benchmarks ({', '.join(ep.name for ep in found) or 'none installed'})",
                       description="Benchmarks installed with specgate (the specgate.bench entry points).")
    kinds = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for ep in found:
        ep.load()(kinds)
