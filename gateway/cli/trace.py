"""`specgate trace build`: record requests as a replay trace (docs/replay.md).

Exit codes: 0 written; 1 the input (requests file, workloads, policy pairs) cannot be traced; 2 usage or
the model is not prepared.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("trace", help="record requests as a trace for exact replay (docs/replay.md)")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = actions.add_parser(
        "build", help="run requests once, plain greedy, on the embedded engine and write their trace",
        description="Serve each request once, greedy, on the embedded engine (as `specgate worker` would "
                    "serve it) and write a JSON Lines trace: header (model revision, tokenizer, draft pairs) "
                    "and per request its features, prompt and output token ids, rounds, timings and each "
                    "draft pair's teacher-forced match flags. The file holds user content: it is created "
                    "0600 and written whole or not at all.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = build.add_mutually_exclusive_group(required=True)
    source.add_argument("--workloads", type=Path,
                        help="the shared workloads directory (its README's format): a seeded sample per slice")
    source.add_argument("--requests", type=Path,
                        help='JSON Lines of {"id", "body": OpenAI chat body, "route"?, "slice"?}')
    build.add_argument("--per-slice", type=int, default=8, help="with --workloads: requests per slice")
    build.add_argument("--slices", nargs="+", default=None, help="with --workloads: the slices (default: all)")
    build.add_argument("--seed", type=int, default=0, help="with --workloads: the sample's seed (the benchmarks' 0)")
    build.add_argument("--max-prompt-chars", type=int, default=6000,
                       help="with --workloads: longer prompts keep their head and tail (as the benchmarks)")
    build.add_argument("--route", default="default", help="with --workloads: the route recorded")
    build.add_argument("--max-new-tokens", type=int, default=256,
                       help="cap on each request's max_tokens (a request's own lower value is kept)")
    build.add_argument("--policy", type=Path, default=None,
                       help="store match flags for every layer_truncated draft pair this policy names")
    build.add_argument("--draft-layers", type=int, action="append", default=None,
                       help="store match flags for the self-draft of this many layers (repeatable; "
                            "default 8, the worker's --draft-layers, unless --policy is given)")
    build.add_argument("--out", type=Path, required=True, help="the trace file (created 0600; replaced if it exists)")
    build.add_argument("--model-dir", type=Path, default=None,
                       help="prepared model directory (default: $SPECGATE_MODEL_DIR or the model cache)")
    build.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    build.set_defaults(func=_build)


def _build(args: argparse.Namespace) -> int:
    from backends.engine.model_store import ModelNotPrepared, load_prepared

    try:
        model = load_prepared(args.model_dir)
    except ModelNotPrepared as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.per_slice < 1 or args.max_new_tokens < 1:
        print("error: --per-slice and --max-new-tokens must be at least 1", file=sys.stderr)
        return 2
    if not args.out.parent.is_dir():
        print(f"error: --out {args.out}: directory {args.out.parent} does not exist", file=sys.stderr)
        return 2

    from gateway.trace_build import BuildError, build, policy_pairs, read_requests, self_draft_pair, workload_requests

    try:
        pairs = {}
        if args.policy is not None:
            from policies.errors import PolicyError
            from policies.load import load_policy_file

            try:
                policy = load_policy_file(args.policy)
            except PolicyError as exc:
                print("\n".join(exc.errors), file=sys.stderr)
                print(f"error: {args.policy}: invalid policy ({len(exc.errors)} error(s))", file=sys.stderr)
                return 1
            pairs.update(policy_pairs(policy, model.revision))
        for layers in args.draft_layers or ([] if args.policy is not None else [8]):
            pair = self_draft_pair(model.name, model.revision, layers)
            pairs[pair.version] = pair
        if args.requests is not None:
            requests = read_requests(args.requests)
        else:
            requests = workload_requests(args.workloads, args.per_slice, args.seed, args.max_prompt_chars,
                                         args.slices, args.route)
    except (BuildError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    from backends.engine.config import EngineConfig
    from backends.engine.engine import Engine

    engine = Engine(EngineConfig(model_path=str(model.path), calibrate=False, num_threads=args.num_threads))
    print(f"tracing {len(requests)} requests on {model.name} ({model.revision}), greedy, max_new_tokens "
          f"<= {args.max_new_tokens}, {len(pairs)} draft pair(s)", file=sys.stderr)
    try:
        summary = build(engine, requests, args.out, model=model.name, revision=model.revision,
                        max_new_tokens=args.max_new_tokens, pairs=pairs)
    except BuildError as exc:
        print(f"error: {exc} (nothing written)", file=sys.stderr)
        return 1
    print(f"{args.out}: {summary.describe(pairs)}")
    return 0
