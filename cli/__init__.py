"""`specgate` command line: one subcommand per module in this package.

Each module exposes ``register(subparsers)`` that adds its parser and sets ``func`` to a callable
taking the parsed namespace and returning an exit code. Heavy imports (torch, litestar) happen inside
those callables so `specgate --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `specgate --help` lists them; a missing one is an import error.
_COMMANDS = ("serve", "up", "worker", "policy", "pair", "model", "trace", "replay", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specgate",
        description="Policy-driven inference gateway with adaptive speculative decoding.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMANDS:
        importlib.import_module(f"cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
