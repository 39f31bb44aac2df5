"""`specgate policy check|schema|explain`: validate a policy, export its JSON Schema, explain a decision.

Exit codes: 0 valid / printed; 1 the policy (or the request/stats file) is invalid; 2 usage errors.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import msgspec

from policies.errors import PolicyError


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("policy", help="validate, export the schema of, or explain a policy file")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser("check", help="validate a policy file and print a summary")
    check.add_argument("file", type=Path)
    check.set_defaults(func=_check)
    schema = actions.add_parser("schema", help="print the policy JSON Schema (for editors)")
    schema.set_defaults(func=_schema)
    explain = actions.add_parser("explain", help="show the slice, matching rule and decision for a request")
    explain.add_argument("file", type=Path)
    what = explain.add_mutually_exclusive_group(required=True)
    what.add_argument("--request", type=Path, help="an OpenAI chat/completions body, or RequestFeatures as JSON")
    what.add_argument("--replay", type=Path, metavar="TRACE",
                      help="replay this policy on the last --last requests of a trace (the gateway's recording "
                           "or specgate trace build), beside --against and plain decoding (docs/replay.md)")
    explain.add_argument("--costs", default=None, metavar="FILE|URL",
                         help="with --replay: the cost model (specgate trace calibrate), or a running specgate "
                              "worker's URL (its live step costs)")
    explain.add_argument("--against", type=Path, default=None,
                         help="with --replay: the policy in force, to compare the candidate with")
    explain.add_argument("--last", type=int, default=500, help="with --replay: the newest N requests")
    explain.add_argument("--loads", nargs="+", default=["trace"],
                         help="with --replay: trace (the recorded arrival times), cN or pR")
    explain.add_argument("--seeds", type=int, default=3, help="with --replay: seeds per load")
    explain.add_argument("--keep", type=int, default=4, help="with --replay: rotated files (TRACE.1 ...) to read "
                         "when TRACE holds fewer than --last requests")
    explain.add_argument("--stats", type=Path, default=None,
                         help="a snapshot JSON (admin endpoint); default: no statistics, every pool "
                              "healthy and verified, concurrency 1")
    explain.add_argument("--route", default=None, help="route of the request (default: the default route)")
    explain.add_argument("--slo-ttft-ms", default=None, metavar="MS",
                         help="with an OpenAI body: the request's x-slo-ttft-ms header (checked as the gateway does)")
    explain.add_argument("--slo-tpot-ms", default=None, metavar="MS",
                         help="with an OpenAI body: the request's x-slo-tpot-ms header (checked as the gateway does)")
    explain.add_argument("--seed", type=int, default=None, help="enable exploration with this seed")
    explain.add_argument("--json", action="store_true", help="print the full trace as JSON")
    explain.set_defaults(func=_explain)


def _load(path: Path):
    from policies.load import load_policy_file  # about 20 ms: specgate --help reads no policy

    try:
        return load_policy_file(path)
    except PolicyError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        print(f"{path}: invalid policy ({len(exc.errors)} error(s))", file=sys.stderr)
        return None


def _check(args: argparse.Namespace) -> int:
    from policies.compiled import served_pools  # see _load

    policy = _load(args.file)
    if policy is None:
        return 1
    routes = ", ".join(r.name for r in policy.routes) or "default (implicit; auth off)"
    slices = ", ".join(dict.fromkeys(s.name for s in policy.slices))
    print(f"{args.file}: valid policy (version {policy.version})")
    print(f"  routes: {routes}")
    print(f"  slices: {slices} (default: {policy.slices[-1].name})")
    for name, pool in policy.pools.items():
        lo, hi = pool.k_range
        k = ("" if pool.proposer == "none"
             else ", k by batch size " + ",".join(f"{span}:{v}" for span, v in pool.k_by_batch.items())
             if pool.k_by_batch else f", adaptive k 0..{hi} per sequence ({pool.strategy})" if pool.adaptive
             else f", k {lo}" + (f"..{hi}" if hi != lo else ""))
        pair = f", pair {pool.pair}@{policy.pool_pair_version(name)}" if pool.pair else ""
        print(f"  pool {name}: {pool.proposer}{k}{pair}, {pool.speculation}, {len(pool.workers)} worker(s)")
    print(f"  rules: {', '.join(r.name for r in policy.rules) or '(none: everything bypasses)'}")
    served = served_pools(policy)
    idle = [name for name, pool in policy.pools.items() if pool.proposer != "none" and name not in served]
    if idle:
        print(f"  not served by any rule: {', '.join(idle)} (no rule speculates with them"
              + ("; each one's pair gate waits for a rule that does, or for POST /admin/pools/NAME/check)"
                 if policy.gates else ")"))
    return max(_check_gates(args.file, policy), _check_tracing(args.file, policy))


def _check_gates(file: Path, policy) -> int:
    """The ``gates:`` section in one line, and its canary file read as the gateway would."""
    from gateway.gates.canary import CanaryError, pick  # the gateway, about 0.08 s: not on specgate --help
    from gateway.gates.runner import canaries_of  # see above

    gates = policy.gates
    if gates is None:
        print("  gates: off (pools serve once their workers report the declared pair)")
        return 0
    try:
        canaries = canaries_of(policy, file.parent)
    except CanaryError as exc:
        print(f"{file}: {exc}", file=sys.stderr)
        return 1
    eq = gates.equivalence
    parts = [f"equivalence: {len(pick(canaries, eq))} canaries ({eq.canaries or 'built-in'}), {eq.max_tokens} tokens"
             + (f", sampled check {eq.sampled.samples} x {eq.sampled.max_tokens} tokens" if eq.sampled else "")]
    if gates.serving:
        parts.append(f"serving ramp from {gates.serving.initial_share:g} per load region")
    if gates.outcome:
        parts.append(f"outcome (after {gates.outcome.min_reports} reports a side)")
    if gates.collapse:
        parts.append(f"collapse floor {gates.collapse.floor:g} over {gates.collapse.window_rounds} rounds")
    print("  gates: " + "; ".join(parts))
    return 0


def _check_tracing(file: Path, policy) -> int:
    """The ``tracing:`` section, resolved as ``specgate serve`` would (without ``--trace``): its folder must exist."""
    from gateway.tracing import problems, resolve  # the gateway, about 0.08 s: not on specgate --help

    config = resolve(policy.tracing, None, file.parent)
    if config is None:
        print("  tracing: off")
        return 0
    routes = ", ".join(sorted(config.routes)) if config.routes else "all"
    print(f"  tracing: {config.path} (max {config.max_bytes} bytes, keep {config.keep}, sample {config.sample:g}, "
          f"seed {config.seed}, routes: {routes})")
    errors = problems(policy, None, file.parent)
    for line in errors:
        print(f"{file}: {line}", file=sys.stderr)
    return 1 if errors else 0


def _schema(args: argparse.Namespace) -> int:
    from policies.schema import Policy  # about 10 ms more on specgate --help: only this subcommand needs it

    print(json.dumps(msgspec.json.schema(Policy), indent=2))
    return 0


def _explain(args: argparse.Namespace) -> int:
    if args.replay is not None:
        return _replay(args)
    from policies.decide import explain  # about 12 ms: only explain needs the decision code
    from policies.features import RequestFeatures, features_from_openai, referenced_headers  # see above
    from policies.snapshot import PoolState, Snapshot, SnapshotData  # see above
    from gateway.errors import ApiError  # see above
    from gateway.slo_headers import TPOT_HEADER, TTFT_HEADER, slo_in_force  # see above

    policy = _load(args.file)
    if policy is None:
        return 1
    route = args.route or policy.default_route or policy.route_names()[0]
    try:
        body = json.loads(args.request.read_text())
        headers = {name: value for name, value in ((TTFT_HEADER, args.slo_ttft_ms), (TPOT_HEADER, args.slo_tpot_ms))
                   if value is not None}
        if isinstance(body, dict) and ("messages" in body or "prompt" in body):
            _, slo_fields = slo_in_force(headers, route, policy)  # the route's SLO, or the flags' as headers
            features = features_from_openai(body, route=route, wanted_headers=referenced_headers(policy),
                                            **slo_fields)
        elif headers:
            print("error: --slo-ttft-ms and --slo-tpot-ms go with an OpenAI body; a features JSON states "
                  "slo_ttft_ms and slo_tpot_ms itself", file=sys.stderr)
            return 2
        else:
            features = msgspec.convert(body, RequestFeatures)
        if args.stats is not None:
            snapshot = Snapshot.from_json(args.stats.read_bytes())
        else:
            pools = {n: PoolState(healthy=True, pair_verified=True, workers_healthy=len(p.workers))
                     for n, p in policy.pools.items()}
            snapshot = Snapshot(SnapshotData(now=0.0, concurrency=1, pools=pools,
                                             half_life_s=policy.learning.half_life_s))
    except ApiError as exc:  # a flag the gateway would refuse as a header (400 naming it)
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    except (OSError, ValueError, msgspec.ValidationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    rng = random.Random(args.seed) if args.seed is not None else None
    trace = explain(policy, features, snapshot, rng=rng)
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(trace), indent=2).decode())
        return 0
    d = trace.decision
    print(f"slice: {trace.slice} (slices[{trace.slice_index}])")
    for r in trace.rules:
        status = "matched" if r.matched else f"no ({r.failed})"
        print(f"rule {r.rule}: {status}")
    for c in trace.candidates:
        name = f"{c.pool} k={c.draft_tokens}" if c.pool else "plain"
        accept = f", accept length {c.expected_accept_length:.2f}" if c.expected_accept_length is not None else ""
        print(f"  option {name}: TPOT {c.predicted_tpot_ms:.1f} ms (sd {c.sd:.2f} in log), speedup "
              f"{c.speedup:.2f}x, {c.samples:.1f} requests here, p_best {c.p_best:.2f}{accept}")
    what = "bypass (no speculation)" if d.bypass else f"{d.proposer} k={d.draft_tokens}"
    print(f"decision: pool {d.pool}, {what}, rule {d.rule}" + (" [safety fallback]" if d.fallback else ""))
    print(f"reason: {d.reason}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    """``policy explain FILE --replay TRACE``: replay/candidate.py on the newest requests."""
    from replay.candidate import ReplayTimeout, recorded, replay_candidate  # about 0.09 s: only --replay needs it
    from cli.costs import load_costs  # see above
    from policies.costmodel import CostModelError  # see above
    from policies.trace import TraceError  # see above

    if args.costs is None:
        print("error: --replay needs --costs FILE or URL (a cost model: specgate trace calibrate --out FILE; or a "
              "running worker's live step costs: --costs http://HOST:PORT)", file=sys.stderr)
        return 2
    if args.last < 1 or args.seeds < 1:
        print("error: --last and --seeds must be at least 1", file=sys.stderr)
        return 2
    from replay.sim import Load  # see above

    try:
        for label in args.loads:
            Load.parse(label)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    candidate = _load(args.file)
    current = _load(args.against) if args.against is not None else None
    if candidate is None or (args.against is not None and current is None):
        return 1
    policies = {**({f"{args.against.stem} (in force)": current} if current is not None else {}),
                args.file.stem: candidate}
    try:
        trace = recorded(args.replay, args.keep, args.last)
        costs = load_costs(args.costs, revision=trace.header.revision)
        result = replay_candidate(trace, policies, costs, loads=tuple(args.loads), seeds=args.seeds,
                                  deadline_s=600.0, source=str(args.replay))
    except (TraceError, CostModelError, ValueError, ReplayTimeout, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(result.markdown)
    return 0
