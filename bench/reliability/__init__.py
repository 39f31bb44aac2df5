"""Full reliability run: the scenarios (``bench/reliability/scenarios.py``) at size, figures as JSON.

``specgate bench reliability`` or ``python -m bench.reliability [--clients 64 --soak-s 300]``: two
real workers, a fresh gateway per scenario; soak (exact greedy answers, RSS start/end), client
disconnects, overload with a noisy and a quiet route, policy reloads under load, kill -9 of a worker
and its restart. Results go to stdout and ``--out`` (docs/reliability.md quotes them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import fields, is_dataclass
from pathlib import Path

from backends.engine.model_store import load_prepared
from bench.processes import gateway, write_policy


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients in the soak")
    p.add_argument("--soak-s", type=float, default=300.0, help="soak duration in seconds")
    p.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per soak request")
    p.add_argument("--disconnects", type=int, default=32, help="clients that drop mid-stream")
    p.add_argument("--reload-rounds", type=int, default=5, help="valid+invalid policy rewrites")
    p.add_argument("--max-resumes", type=int, default=None,
                   help="the worker-fault scenario's policy resume.max_resumes (default: the policy's default; "
                        "0: in-flight streams are not resumed, as before issue 57)")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS,
                   help="which scenarios to run")
    p.add_argument("--out", type=Path, default=Path("results/reliability.json"))


SCENARIOS = ("soak", "overload", "reloads", "faults")  # soak includes memory and client disconnects


def register(kinds: argparse._SubParsersAction) -> None:
    """``specgate bench reliability`` (the ``specgate.bench`` entry point, pyproject.toml)."""
    p = kinds.add_parser("reliability", help="soak, faults, disconnects, overload, reloads",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         description="Reliability run through the gateway to two real workers (docs/reliability.md).")
    add_arguments(p)
    p.set_defaults(func=run)


def _plain(value):
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (set, list, tuple)):
        return [_plain(v) for v in value]
    return value


def run(args: argparse.Namespace) -> int:
    from bench.reliability import scenarios  # about 0.07 s: specgate --help loads this module
    from bench.reliability.cluster import Workers, listener_pid, policy_yaml, rss_mb  # see above

    revision = load_prepared().revision
    out: dict = {"args": {k: str(v) for k, v in vars(args).items() if k != "func"}}
    with tempfile.TemporaryDirectory(prefix="specgate-reliability-") as tmp_name:
        tmp = Path(tmp_name)
        workers = Workers(tmp)
        try:
            workers.start()
            urls = workers.urls

            def policy(name: str, **kw) -> Path:
                return write_policy(tmp / f"{name}.yaml", policy_yaml(revision=revision, **kw))

            def step(name: str, value) -> None:
                out[name] = _plain(value)
                print(f"{name}: {json.dumps(out[name])}", flush=True)

            run_ = set(args.scenarios)
            if "soak" in run_:
                with gateway(tmp, policy("soak", plain=urls, ngram=urls)) as gw:
                    pids = {"gateway": listener_pid(gw), **{f"worker{i}": p for i, p in enumerate(workers.pids())}}
                    rss0 = {k: round(rss_mb(p), 1) for k, p in pids.items()}
                    soak = asyncio.run(scenarios.soak(gw, urls[0], clients=args.clients, requests=0,
                                                      max_tokens=args.max_tokens, duration_s=args.soak_s))
                    rss1 = {k: round(rss_mb(p), 1) for k, p in pids.items()}
                    step("soak", {**_plain(soak), "rss_mb_start": rss0, "rss_mb_end": rss1})
                    t0 = time.monotonic()
                    worst = asyncio.run(scenarios.disconnects(gw, urls, clients=args.disconnects))
                    step("disconnects", {"clients": args.disconnects, "worst_back_to_baseline_s": round(worst, 3),
                                         "seconds": round(time.monotonic() - t0, 1)})
            if "overload" in run_:
                with gateway(tmp, policy("overload", plain=urls, ngram=urls, routes=scenarios.OVERLOAD_ROUTES),
                             env=scenarios.OVERLOAD_KEYS) as gw:
                    step("overload", asyncio.run(scenarios.overload(gw, noisy=12, quiet=8)))
            if "reloads" in run_:
                path = policy("reload", plain=urls, ngram=urls)
                with gateway(tmp, path) as gw:
                    step("reloads", asyncio.run(scenarios.reloads(gw, path, urls, revision,
                                                                  rounds=args.reload_rounds, clients=4)))
            if "faults" in run_:
                with gateway(tmp, policy("faults", plain=urls, ngram=urls[1:], max_resumes=args.max_resumes)) as gw:
                    step("faults", asyncio.run(scenarios.kill_worker(gw, workers, 1, in_flight=8, after=8)))
        finally:
            workers.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reliability", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
