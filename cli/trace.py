"""`specgate trace build`: record requests as a replay trace; `specgate trace calibrate`: measure the cost
model that times them in replay (docs/replay.md).

Exit codes: 0 written; 1 the input (requests file, workloads, policy pairs, calibration settings) cannot
be used; 2 usage or the model is not prepared, or ``calibrate --from-worker``'s worker cannot be read or
reports no usable step costs.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

from backends.engine.calibrate import (DEFAULT_BATCHES, DEFAULT_CONTEXTS, DEFAULT_PREFILL_TOKENS, DEFAULT_WIDTHS,
                                       PROPOSERS, calibrate, default_text, describe_hardware, self_check)
from backends.engine.model_store import ModelNotPrepared, load_prepared
from policies.errors import PolicyError


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
    source = build.add_mutually_exclusive_group()
    source.add_argument("--workloads", type=Path, default=None,
                        help="a seeded sample per slice from this workloads directory (workloads/README.md's "
                             "layout; default, without --requests: $SPECGATE_WORKLOADS, else the sample in workloads/)")
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
    _register_calibrate(actions)


def _register_calibrate(actions: argparse._SubParsersAction) -> None:
    calibrate = actions.add_parser(
        "calibrate", help="measure the replay cost model (forward, prefill, draft and overhead seconds)",
        description="Time the embedded engine's target forwards by width (tokens fed: k + 1), context length and "
                    "batch (sequences in one step's forward), prefill chunks, each proposer's drafting and the per-round overhead (medians after a "
                    "warm-up), write the cost model replay times rounds with, and set real rounds (plain and "
                    "ngram k = 4) beside the model's prediction. Measure on a quiet machine: the file is what "
                    "replay believes this machine does.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    calibrate.add_argument("--out", type=Path, required=True, help="the cost model file (JSON; replaced if it exists)")
    calibrate.add_argument("--from-worker", metavar="URL", default=None,
                           help="measure nothing: write the live step costs a running specgate worker reports in "
                                "/server_info (one context length; docs/replay.md); the other flags are ignored")
    calibrate.add_argument("--model-dir", type=Path, default=None,
                           help="prepared model directory (default: $SPECGATE_MODEL_DIR or the model cache)")
    calibrate.add_argument("--num-threads", type=int, default=None,
                           help="torch intra-op threads (default: torch's, as `specgate worker` runs; give the "
                                "worker's value if it sets one)")
    calibrate.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                           help="the weights' dtype, as the worker's --dtype")
    calibrate.add_argument("--repeats", type=int, default=5, help="timed repeats per point (the median is kept)")
    calibrate.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS),
                           help="context lengths (tokens cached) to measure at; span the prompts replay will see")
    calibrate.add_argument("--widths", type=int, nargs="+", default=list(DEFAULT_WIDTHS),
                           help="tokens fed per forward (k + 1); others interpolate")
    calibrate.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BATCHES),
                           help="sequences per step to measure the forward grid at (1 is always measured); "
                                "span the worker's --max-running-requests: above the largest, replay scales "
                                "proportionally")
    calibrate.add_argument("--prefill-tokens", type=int, nargs="+", default=list(DEFAULT_PREFILL_TOKENS),
                           help="prefill chunk sizes to measure (the engine's chunk is 256)")
    calibrate.add_argument("--proposers", nargs="+", choices=PROPOSERS, default=list(PROPOSERS),
                           help="proposers whose drafting to time")
    calibrate.add_argument("--draft-layers", type=int, default=8,
                           help="the self-draft's layers (draft_model), as the worker's --draft-layers")
    calibrate.add_argument("--text", type=Path, default=None,
                           help="a text file whose token ids are fed (default: Python's argparse source, real "
                                "code; ngram and suffix timings depend a little on the text)")
    calibrate.set_defaults(func=_calibrate)


def _prepared(args: argparse.Namespace, bad: str | None):
    """The prepared model, or None after printing why the command cannot start (``bad``: a usage problem
    of the caller's own flags; then a missing --out directory)."""
    try:
        model = load_prepared(args.model_dir)
    except ModelNotPrepared as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    if bad is None and not args.out.parent.is_dir():
        bad = f"--out {args.out}: directory {args.out.parent} does not exist"
    if bad is not None:
        print(f"error: {bad}", file=sys.stderr)
        return None
    return model


def _build(args: argparse.Namespace) -> int:
    model = _prepared(args, "--per-slice and --max-new-tokens must be at least 1"
                      if args.per_slice < 1 or args.max_new_tokens < 1 else None)
    if model is None:
        return 2

    from replay.trace_build import (  # about 20 ms: only a build needs it
        BuildError, build, policy_pairs, read_requests, self_draft_pair, workload_requests)

    try:
        pairs = {}
        if args.policy is not None:
            from policies.load import load_policy_file  # about 20 ms: specgate --help reads no policy

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

    from backends.engine.config import EngineConfig  # with Engine: torch, about 6 s
    from backends.engine.engine import Engine  # see above

    engine = Engine(EngineConfig(model_path=str(model.path), calibrate=False, num_threads=args.num_threads))
    print(f"tracing {len(requests)} requests on {model.name} ({model.revision}), greedy, max_new_tokens "
          f"<= {args.max_new_tokens}, {len(pairs)} draft pair(s)", file=sys.stderr)
    from telemetry.progress import track  # about 0.05 s: only a run shows progress

    try:
        summary = build(engine, track(requests, "trace build", len(requests)), args.out, model=model.name,
                        revision=model.revision, max_new_tokens=args.max_new_tokens, pairs=pairs)
    except BuildError as exc:
        print(f"error: {exc} (nothing written)", file=sys.stderr)
        return 1
    print(f"{args.out}: {summary.describe(pairs)}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    if args.from_worker is not None:
        return _from_worker(args.from_worker, args.out)
    bad = (min(args.repeats, min(args.widths), min(args.prefill_tokens), min(args.batches)) < 1
           or min(args.contexts) < 0)
    model = _prepared(args, "--repeats, --widths, --prefill-tokens and --batches must be at least 1, --contexts "
                      "at least 0" if bad else None)
    if model is None:
        return 2

    from backends.engine.config import EngineConfig  # with Engine: torch, about 6 s
    from backends.engine.engine import Engine  # see above
    from policies.costmodel import from_measurements, write_cost_model  # about 20 ms more on specgate --help

    try:
        text = args.text.read_text(encoding="utf-8") if args.text is not None else default_text()
    except (OSError, ValueError) as exc:
        print(f"error: --text: {exc}", file=sys.stderr)
        return 1
    engine = Engine(EngineConfig(model_path=str(model.path), dtype=args.dtype, calibrate=False,
                                 num_threads=args.num_threads, draft_layers=args.draft_layers))
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    hardware = describe_hardware(args.dtype)
    print(f"calibrating {model.name} ({model.revision}) on {hardware}: contexts {sorted(set(args.contexts))}, "
          f"widths {sorted(set(args.widths))}, batches {sorted({1, *args.batches})}, {args.repeats} repeats",
          file=sys.stderr)
    from telemetry.progress import Progress  # about 0.05 s: only a run shows progress

    def stage(line: str) -> None:  # each measured stage: its line above the bar, and a step of it
        bar.note(f"  {line}")
        bar.advance()

    try:
        with Progress("calibrate: stages measured", None) as bar:
            measured = calibrate(engine, ids, model=model.name, revision=model.revision, contexts=args.contexts,
                                 widths=args.widths, prefill_tokens=args.prefill_tokens, repeats=args.repeats,
                                 proposers=args.proposers, draft_layers=args.draft_layers, hardware=hardware,
                                 batches=args.batches, progress=stage)
        cost = from_measurements(measured)  # a CostModelError is a ValueError
    except ValueError as exc:
        print(f"error: {exc} (nothing written)", file=sys.stderr)
        return 1
    write_cost_model(args.out, cost)
    print(f"{args.out}: cost model of {model.name} ({model.revision}) on {hardware}")
    for line in _summary(cost):
        print(f"  {line}")
    print("self-check, real rounds beside round_s (predicted / measured, median per round; wall: from one "
          "round's output to the next):")
    off = []
    for arm in self_check(engine, cost.round_s, {name: d.call_s for name, d in cost.draft.items()}, ids):
        print(f"  {arm.arm}: {arm.rounds} rounds, predicted {1e3 * arm.predicted_s:.2f} ms, measured "
              f"{1e3 * arm.measured_s:.2f} ms (ratio {arm.ratio:.2f}), wall {1e3 * arm.wall_s:.2f} ms (ratio "
              f"{arm.wall_ratio:.2f})")
        if not 0.8 <= arm.ratio <= 1.25:
            off.append(f"{arm.arm} {arm.ratio:.2f}")
    if off:
        # measured: a calibration while another job ran torch beside it predicted 55x the real rounds
        print(f"warning: the model is off the engine's own rounds ({', '.join(off)}; expected 0.8-1.25): the "
              "machine was probably busy while it measured (another process, or torch threads oversubscribed); "
              "recalibrate on a quiet machine before trusting replay's times", file=sys.stderr)
    return 0


def _from_worker(url: str, out: Path) -> int:
    """``trace calibrate --from-worker URL``: the cost model of the worker's live step costs
    (policies.live_costs.from_server_info), written as a measured one is."""
    from cli.costs import live_cost_model  # about 20 ms (the SGLang client): only --from-worker needs it
    from policies.costmodel import CostModelError, write_cost_model  # about 20 ms more on specgate --help

    if not out.parent.is_dir():
        print(f"error: --out {out}: directory {out.parent} does not exist", file=sys.stderr)
        return 2
    try:
        cost = live_cost_model(url, created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    except CostModelError as exc:
        print(f"error: {exc} (nothing written)", file=sys.stderr)
        return 2
    write_cost_model(out, cost)
    print(f"{out}: cost model of {cost.model} ({cost.revision}) from {cost.source}")
    for line in _summary(cost):
        print(f"  {line}")
    return 0


def _summary(cost) -> list[str]:
    ms = lambda seconds: f"{1e3 * seconds:.2f} ms"  # noqa: E731
    ends = lambda values: sorted({values[0], values[-1]})  # noqa: E731  (one context: a live model's)
    low = cost.forward[0].context[0]
    lines = [f"forward, width {w}: " + ", ".join(f"{ms(cost.forward_s(w, c))} at context {c}"
                                                   for c in ends(cost.forward[0].context)) for w in (1, 9)]
    lines += [f"forward of {b} sequences, width 1 at context {low}: {ms(cost.forward_s(1, low, b))} "
              f"({cost.forward_s(1, low, b) / cost.forward_s(1, low):.2f}x one)" for b in cost.batch[1:]]
    chunk = cost.prefill.tokens[-1]
    lines.append(f"prefill, {chunk} tokens: " + ", ".join(f"{ms(cost.prefill_s(chunk, c))} at context {c}"
                                                          for c in ends(cost.prefill.context)))
    for name, draft in cost.draft.items():
        if draft.context:
            per_token = (f", {ms(draft.token(draft.context[0]))} per token at context {draft.context[0]} to "
                         f"{ms(draft.token(draft.context[-1]))} at {draft.context[-1]}")
        else:
            per_token = f", {ms(draft.token(0))} per token at any context" if draft.token_s else ""
        lines.append(f"draft {name}: {1e6 * draft.call_s:.1f} us per call{per_token}; once per request "
                     f"{1e6 * draft.setup_token_s:.1f} us per prompt token")
    lines.append(f"overhead: {ms(cost.overhead_s)} per round")
    return lines
