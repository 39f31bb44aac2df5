"""Counterfactual exactness at size: replay's per-round counts against the real engine's rounds.

    .venv/bin/python -m bench.replay_exact --num-threads 1 --out /tmp/exact.json
    specgate bench replay-exact --per-slice 2 --ks 4

Replay (``backends/engine/counterfactual.py``) claims that for a greedy request the rounds any fixed
proposer would run follow from the prompt and output ids alone (plus, for the self-draft, one teacher-forced
pass's match flags). ``tests/engine/test_counterfactual.py`` checks that on a few short prompts; this runs
the same comparison on the seeded workload sample (``replay.trace_build.workload_requests``, the draw
``specgate trace build`` makes), every request translated as the worker translates a chat body (chat
template, tools, sampling checks; greedy, ``max_tokens`` capped) and served on one fp32 engine, stepped here.

Per request: one plain run gives the output ids O; one teacher-forced pass of the self-draft gives its
match flags and top-2 margins; then for every proposer and k the engine runs the request for real and its
rounds are compared, one for one, with ``replay`` on (prompt, O):

- its output ids must equal O (greedy speculation is exact);
- its per-round (drafted, accepted) must equal the replay's. ``RequestStats`` keeps only totals, so the
  rounds are taken where the engine records them: :class:`RoundTap` wraps ``RequestStats.record`` for the
  run, as the engine tests' ``RoundLog`` does.

One difference is documented and counted apart, never hidden (docs/replay.md, "Where replay and the engine's
counters can differ"): when a stop token ends the request, the engine counts every draft the target agreed
with in the last round, also those past the stop, and replay cannot know them. That case is exactly: the
request stopped, every round equal except the last, whose drafted count is equal and whose engine accepted
count is larger. Anything else (a different round, a different output) is a difference and the exit status
is 1. ``longest`` (the most drafts the engine accepted in one round) says whether k = 4 and 8 compared
anything k = 1 did not: a draft that never matches twice in a row accepts the same at every k. Near ties
(self-draft positions whose top-2 margin is under 1e-3, where float rounding could flip a
flag) are counted beside the self-draft's rows.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from backends.engine.config import EngineConfig
from backends.engine.model_store import ModelNotPrepared, load_prepared
from backends.engine.types import MAX_DRAFT_TOKENS, RequestStats, SpeculationParams
from bench.processes import cpu_model
from bench.workloads import DEFAULT_ROOT

SLICES = ("code", "tool_call", "prose", "long_context", "code_edit")  # replay/workloads.py's, all five
PROPOSERS = ("ngram", "draft_model")
NEAR_TIE = 1e-3  # DraftMatches.near_ties: an order of magnitude above the largest logit difference measured

EQUAL, AFTER_STOP, DIFFER = "equal", "after stop", "differ"


def compare_rounds(engine: Sequence[tuple[int, int]], replayed: Sequence[tuple[int, int]],
                   stopped: bool) -> tuple[str, int]:
    """The verdict on one request's rounds and how many rounds agree position by position. ``AFTER_STOP``
    is the documented case only: ``stopped``, the same number of rounds, all equal but the last, where the
    drafted counts agree and the engine accepted more."""
    same = sum(e == r for e, r in zip(engine, replayed))
    if list(engine) == list(replayed):
        return EQUAL, same
    if (stopped and engine and len(engine) == len(replayed) and same == len(engine) - 1
            and engine[-1][0] == replayed[-1][0] and engine[-1][1] > replayed[-1][1]):
        return AFTER_STOP, same
    return DIFFER, same


@dataclass
class Cell:
    """One slice x proposer x k: counters over its requests."""

    requests: int = 0
    rounds: int = 0  # rounds compared: the longer of the two round lists, per request
    rounds_equal: int = 0
    identical: int = 0  # requests whose output ids equal the plain run's
    accepted: int = 0  # drafts the engine accepted
    accepted_replay: int = 0
    longest: int = 0  # most drafts the engine accepted in one round (k = 4 and 8 test more only when > 1)
    after_stop: int = 0  # requests in the documented stop-token case
    stop_extra: int = 0  # drafts the engine accepted past the stop in those requests (replay cannot see them)
    near_ties: int = 0  # self-draft positions with a top-2 margin under NEAR_TIE (draft_model rows)
    differ: list[str] = field(default_factory=list)  # request ids that differ otherwise

    def add(self, other: Cell) -> None:
        for name in ("requests", "rounds", "rounds_equal", "identical", "accepted", "accepted_replay",
                     "after_stop", "stop_extra", "near_ties"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.longest = max(self.longest, other.longest)
        self.differ += other.differ


class RoundTap:
    """Every RoundStats the engine records while open, per request (by its RequestStats object, kept alive
    until taken so ids are not reused). Wraps ``RequestStats.record`` and restores it on exit."""

    def __init__(self) -> None:
        self._rounds: dict[int, tuple[Any, list]] = {}

    def __enter__(self) -> RoundTap:
        self._original = original = RequestStats.record
        rounds = self._rounds

        def record(stats, r) -> None:
            rounds.setdefault(id(stats), (stats, []))[1].append(r)
            original(stats, r)

        RequestStats.record = record  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        RequestStats.record = self._original  # type: ignore[method-assign]

    def take(self, output: Any) -> list[tuple[int, int]]:
        """(drafted, accepted) per round of the request whose final event ``output`` is."""
        _, rounds = self._rounds.pop(id(output.stats), (None, []))
        return [(r.k, r.accepted) for r in rounds]


def translate(engine: Any, line: Any, max_new_tokens: int, rid: str) -> Any:
    """A workload line as the worker serves it (replay/trace_build.py's translation): greedy, ``max_tokens``
    capped, no speculation."""
    from backends.sglang import openai_wire  # about 20 ms with those below: specgate --help loads this module
    from backends.worker.errors import BadRequest  # see above
    from backends.worker.translate import Limits, chat_request  # see above
    from replay.trace_build import served_body  # see above

    limits = Limits(context_length=engine.context_length, default_speculation=SpeculationParams())
    try:
        body = msgspec.convert(served_body(line.body, max_new_tokens), openai_wire.ChatCompletionRequest)
        request = chat_request(body, engine.tokenizer, limits)
    except (BadRequest, msgspec.ValidationError) as exc:
        raise ValueError(f"request {line.id!r}: the worker would refuse it: {exc}") from None
    return replace(request, rid=rid, speculation=SpeculationParams())


def check_request(engine: Any, tap: RoundTap, line: Any, n: int, max_new_tokens: int,
                  proposers: Sequence[str], ks: Sequence[int]) -> dict:
    """Plain once, the self-draft's flags once, then every proposer x k on the engine against replay."""
    from backends.engine.counterfactual import Recorded, draft_matches, replay  # torch (~2 s): specgate --help loads this module

    request = translate(engine, line, max_new_tokens, f"exact-{n}-plain")
    plain = engine.generate(request)
    tap.take(plain)
    output = tuple(plain.output_ids)
    sampling = request.sampling
    stops = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else engine.eos_ids)
    matched = draft_matches(engine.draft_runner, request.input_ids, output, sampling, stops) \
        if "draft_model" in proposers else None
    record = Recorded(prompt=tuple(request.input_ids), output=output, max_new_tokens=sampling.max_new_tokens)
    finish = plain.finish_reason.type if plain.finish_reason else "none"
    detail: dict = {"id": line.id, "slice": line.slice, "prompt_tokens": len(request.input_ids),
                    "output_tokens": len(output), "finish": finish, "runs": {}}
    if matched is not None:
        detail["draft"] = {"matches": sum(matched.matches), "near_ties": matched.near_ties(NEAR_TIE),
                           "smallest_margin": min(matched.margins, default=None)}
    for proposer in proposers:
        for k in ks:
            spec = SpeculationParams(proposer=proposer, draft_tokens=k)
            out = engine.generate(replace(request, rid=f"exact-{n}-{proposer}-{k}", speculation=spec))
            rounds = tap.take(out)
            [result] = replay([record], spec, matches=[matched.matches] if proposer == "draft_model" else None)
            replayed = list(zip(result.drafted, result.accepted))
            stopped = out.finish_reason is not None and out.finish_reason.type == "stop"
            verdict, same = compare_rounds(rounds, replayed, stopped)
            identical = tuple(out.output_ids) == output
            detail["runs"][f"{proposer}-k{k}"] = {
                "identical": identical, "verdict": verdict if identical else DIFFER, "rounds_equal": same,
                "engine": rounds, "replay": replayed}
    return detail


def cells(details: Sequence[dict], proposers: Sequence[str], ks: Sequence[int]) -> dict[tuple, Cell]:
    """(slice, proposer, k) -> Cell, in slice order of first appearance."""
    out: dict[tuple, Cell] = {}
    for d in details:
        for proposer in proposers:
            for k in ks:
                run = d["runs"][f"{proposer}-k{k}"]
                c = out.setdefault((d["slice"], proposer, k), Cell())
                c.requests += 1
                c.rounds += max(len(run["engine"]), len(run["replay"]))
                c.rounds_equal += run["rounds_equal"]
                c.identical += run["identical"]
                c.accepted += sum(a for _, a in run["engine"])
                c.accepted_replay += sum(a for _, a in run["replay"])
                c.longest = max([c.longest, *(a for _, a in run["engine"])])
                if run["verdict"] == AFTER_STOP:
                    c.after_stop += 1
                    c.stop_extra += run["engine"][-1][1] - run["replay"][-1][1]
                c.near_ties += d["draft"]["near_ties"] if proposer == "draft_model" else 0
                if run["verdict"] == DIFFER:
                    c.differ.append(d["id"])
    return out


def run(engine: Any, lines: Sequence[Any], *, max_new_tokens: int, proposers: Sequence[str] = PROPOSERS,
        ks: Sequence[int] = (1, 4, 8), progress: Callable[[int, dict, float], None] | None = None) -> list[dict]:
    """Every line through :func:`check_request` on ``engine`` (a backends.engine.Engine, not started: it is
    stepped here), one request at a time. Returns the per-request details."""
    details = []
    with RoundTap() as tap:
        for n, line in enumerate(lines):
            started = time.perf_counter()
            details.append(check_request(engine, tap, line, n, max_new_tokens, proposers, ks))
            details[-1]["seconds"] = round(time.perf_counter() - started, 2)
            if progress is not None:
                progress(n, details[-1], details[-1]["seconds"])
    return details


def table(details: Sequence[dict], proposers: Sequence[str], ks: Sequence[int]) -> tuple[str, Cell]:
    """The markdown table per slice x proposer x k and its total line; also the total Cell."""
    rows = ["| slice | proposer | k | requests | rounds compared | rounds equal | identical output | drafts accepted "
            "| longest | after a stop (documented) | near ties | differ |", "|---" * 12 + "|"]
    total = Cell()
    for (slice_, proposer, k), c in cells(details, proposers, ks).items():
        total.add(c)
        rows.append(_row(slice_, proposer, str(k), c))
    # near ties belong to a request's flags, not to a k: the total counts each request's once
    total.near_ties = sum(d["draft"]["near_ties"] for d in details if "draft" in d)
    rows.append(_row("**total**", "", "", total))
    return "\n".join(rows), total


def _row(slice_: str, proposer: str, k: str, c: Cell) -> str:
    stop = f"{c.after_stop} (+{c.stop_extra} accepted)" if c.after_stop else "0"
    ties = str(c.near_ties) if proposer in ("draft_model", "") else "-"
    differ = f"{len(c.differ)}: {', '.join(sorted(set(c.differ)))}" if c.differ else "0"
    return (f"| {slice_} | {proposer} | {k} | {c.requests} | {c.rounds} | {c.rounds_equal} | {c.identical} | "
            f"{c.accepted} | {c.longest} | {stop} | {ties} | {differ} |")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _draft_length(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"k must be in 1..{MAX_DRAFT_TOKENS}, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", type=Path, default=DEFAULT_ROOT,
                   help="a full copy of the workload sets (default: $SPECGATE_WORKLOADS, else the sample in workloads/)")
    p.add_argument("--per-slice", type=_positive, default=20, help="requests per slice (the seeded sample)")
    p.add_argument("--slices", nargs="+", default=list(SLICES), choices=SLICES, metavar="SLICE",
                   help=f"of {', '.join(SLICES)}")
    p.add_argument("--ks", nargs="+", type=_draft_length, default=[1, 4, 8], metavar="K", help="draft lengths")
    p.add_argument("--proposers", nargs="+", default=list(PROPOSERS), choices=PROPOSERS, metavar="PROPOSER",
                   help=f"of {', '.join(PROPOSERS)} (draft_model: the layer-truncated self-draft)")
    p.add_argument("--draft-layers", type=_positive, default=8, help="the self-draft's layers (the worker's 8)")
    p.add_argument("--max-new-tokens", type=_positive, default=32, help="cap on every request's max_tokens")
    p.add_argument("--max-prompt-chars", type=_positive, default=6000,
                   help="longer prompts keep their head and tail (as the serving benchmark)")
    p.add_argument("--seed", type=int, default=0, help="the sample's seed (the benchmarks' 0)")
    p.add_argument("--num-threads", type=_positive, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="prepared model directory (default: $SPECGATE_MODEL_DIR or the model cache)")
    p.add_argument("--out", type=Path, default=None, help="write the per-request details (rounds, verdicts) as JSON")


def register(kinds: argparse._SubParsersAction) -> None:
    """``specgate bench replay-exact`` (the ``specgate.bench`` entry point, pyproject.toml)."""
    p = kinds.add_parser("replay-exact", help="replay's rounds against the engine's, one for one",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         description="Counterfactual exactness: replayed per-round accepted counts of ngram and "
                                     "the self-draft against the real engine (docs/replay.md).")
    add_arguments(p)
    p.set_defaults(func=lambda args: execute(args, "specgate bench replay-exact " + " ".join(
        sys.argv[sys.argv.index("replay-exact") + 1:] if "replay-exact" in sys.argv else [])))


def execute(args: argparse.Namespace, command: str) -> int:
    """Load the model, run, print the command, environment, table and runtime. 0: every round equal (or
    the documented stop-token case); 1: anything else differs, or the input cannot be run; 2: no model."""
    from replay.trace_build import workload_requests  # about 20 ms: specgate --help loads this module

    try:
        lines = workload_requests(args.workloads, args.per_slice, args.seed, args.max_prompt_chars, args.slices)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        model = load_prepared(args.model_dir)
    except ModelNotPrepared as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch  # about 2 s: specgate --help loads this module
    import transformers  # about 1.3 s: specgate --help loads this module

    from backends.engine.engine import Engine  # torch, about 6 s: specgate --help loads this module

    engine = Engine(EngineConfig(model_path=str(model.path), calibrate=False, draft_layers=args.draft_layers,
                                 num_threads=args.num_threads))
    header = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "model": f"{model.name} ({model.revision})", "dtype": engine.config.dtype, "cpu": cpu_model(),
              "threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
              "transformers": transformers.__version__, "requests": len(lines)}
    print(json.dumps(header, indent=1), flush=True)
    started = time.perf_counter()
    try:
        details = _run_with_progress(engine, lines, args)
    except ValueError as exc:  # a request the worker would refuse (e.g. longer than the context window)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    wall = time.perf_counter() - started
    text, total = table(details, args.proposers, args.ks)
    print(text)
    for d in details:  # the documented case, shown one by one
        for name, r in d["runs"].items():
            if r["verdict"] == AFTER_STOP:
                print(f"after a stop: {d['id']} {name}: last round (drafted, accepted) engine "
                      f"{tuple(r['engine'][-1])}, replay {tuple(r['replay'][-1])}")
    margins = [d["draft"]["smallest_margin"] for d in details if d.get("draft", {}).get("smallest_margin") is not None]
    stops = sum(d["finish"] == "stop" for d in details)
    print(f"\n{len(details)} requests ({stops} ended by a stop token, the rest by length), "
          f"{sum(d['output_tokens'] for d in details)} output tokens; wall {wall / 60:.1f} min")
    if margins:
        matches = sum(d["draft"]["matches"] for d in details)
        print(f"self-draft ({args.draft_layers} layers): argmax = committed token at {matches} positions; "
              f"smallest top-2 margin {min(margins):.2g}; near ties (< {NEAR_TIE:g}): "
              f"{sum(d['draft']['near_ties'] for d in details)}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**header, "wall_s": round(wall, 1), "requests": details}, indent=1) + "\n")
        print(f"wrote {args.out}")
    if total.differ:
        print(f"DIFFER: {len(total.differ)} runs differ beyond the documented stop-token case", file=sys.stderr)
        return 1
    return 0


def _run_with_progress(engine: Any, lines: Sequence[Any], args: argparse.Namespace) -> list[dict]:
    """A bar on a terminal; under nohup or a pipe, plain progress lines on stderr (telemetry/progress.py)."""
    from telemetry.progress import Progress  # about 0.05 s: specgate --help loads this module

    def verdicts(detail: dict) -> str:
        bad = [name for name, r in detail["runs"].items() if r["verdict"] != EQUAL]
        return "all equal" if not bad else ", ".join(f"{n}: {detail['runs'][n]['verdict']}" for n in bad)

    common = {"max_new_tokens": args.max_new_tokens, "proposers": args.proposers, "ks": args.ks}
    with Progress("replay exactness", len(lines)) as bar:
        return run(engine, lines, progress=lambda n, d, s: bar.advance(
            description=f"{d['slice']} {d['id']}: {d['output_tokens']} tokens, {s:.1f} s, {verdicts(d)}"), **common)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.replay_exact", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return execute(parser.parse_args(argv), "python -m bench.replay_exact " + " ".join(argv))


if __name__ == "__main__":
    sys.exit(main())
