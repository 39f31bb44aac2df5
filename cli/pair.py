"""`specgate pair check --policy FILE --pool NAME`: run a pool's equivalence gate now and print its verdict.

It runs the gate as the gateway does (``gateway/gates/``): the policy's canaries (or the built-in set) through
the pool's workers and the plain reference, greedy identity and the sampled check, within the policy's
budget, straight against the workers (no gateway needed; a running gateway re-checks a pool with
``POST /admin/pools/NAME/check``). Without a ``gates:`` section the defaults apply.

Exit codes: 0 passed; 1 failed (the pair is not equivalent); 2 usage or an invalid policy; 3 the gate could
not run (no healthy worker, no plain reference, a worker error, past the budget).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import msgspec

from policies.errors import PolicyError


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("pair", help="check a pool's target-draft pair (its equivalence gate)")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser("check", help="run a pool's equivalence gate and print the verdict")
    check.add_argument("--policy", type=Path, required=True, help="the policy file naming the pool")
    check.add_argument("--pool", required=True, help="the speculative pool to check")
    check.add_argument("--json", action="store_true", help="print the verdict as JSON")
    check.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    import structlog  # about 30 ms: only a check configures logging

    from gateway.gates.canary import CanaryError  # the gateway, about 0.08 s: not on specgate --help
    from gateway.gates.runner import canaries_of  # see above
    from policies.load import load_policy_file  # about 20 ms: specgate --help reads no policy
    from policies.schema import Gates  # about 10 ms more on specgate --help: only this subcommand needs it
    from telemetry.logs import configure_logging  # about 50 ms: only a check configures logging

    try:
        policy = load_policy_file(args.policy)
    except PolicyError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 2
    pool = policy.pools.get(args.pool)
    if pool is None or pool.proposer == "none" or not pool.pair:
        speculative = [n for n, p in policy.pools.items() if p.proposer != "none" and p.pair]
        print(f"--pool {args.pool}: not a speculative pool with a pair in {args.policy}; choose one of: "
              f"{', '.join(speculative) or '(none)'}", file=sys.stderr)
        return 2
    try:
        canaries = canaries_of(policy, args.policy.parent)
    except CanaryError as exc:
        print(exc, file=sys.stderr)
        return 2
    settings = (policy.gates or Gates()).equivalence
    saved = structlog.get_config()
    configure_logging(json=False, level="warning", stream=sys.stderr)  # stdout holds the verdict (--json) only
    try:
        verdict = asyncio.run(_run(policy, args.pool, canaries, settings))
    finally:
        structlog.configure(**saved)
    if args.json:
        print(msgspec.json.encode(verdict).decode())
    else:
        word = "error" if verdict.error else "passed" if verdict.passed else "FAILED"
        print(f"pool {args.pool} (pair {pool.pair}@{policy.pool_pair_version(args.pool)}): {word}: {verdict.reason}")
        if verdict.seconds:
            print(f"  {verdict.canaries} canaries, {verdict.tokens} tokens compared, {verdict.seconds:.1f} s"
                  + (f", worker {verdict.worker}" if verdict.worker else ""))
    return 3 if verdict.error else 0 if verdict.passed else 1


async def _run(policy, pool: str, canaries, settings):
    from gateway.backend import Backend  # the gateway, about 0.06 s: not on specgate --help
    from gateway.gates.runner import check_pool  # see above

    backend = Backend(policy, monitor_interval_s=60.0, read_timeout_s=settings.timeout_s)
    await backend.start()  # one monitor round: health, load and identity of every worker, and the catalog
    try:
        return await check_pool(policy, pool, backend, canaries, settings)
    finally:
        await backend.stop()
