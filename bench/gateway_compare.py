"""Two specgate gateways side by side in one run: a before/after benchmark of the gateway's own cost.

    git worktree add /tmp/wt-before REV
    git show REV:deploy/policies/default.yaml > /tmp/before-policy.yaml   # a policy both trees accept
    .venv/bin/python -m bench.gateway_compare --before /tmp/wt-before --policy /tmp/before-policy.yaml \\
        --rounds 10 --duration 5 --concurrency 1 32 [--stream] [--together]

One instant worker (``bench/instant_worker.py``, the stand-in that answers at once, so only the gateway's
cost remains) and BOTH gateways stay up for the whole run, each from its own checkout (``--before`` and
``--after``, default this one). Every round measures each concurrency on both, in alternating order
(ABBA: a round where before runs first is followed by one where after runs first), so a drift of the
machine or a second-position penalty falls on both alike. Per round and concurrency: wrk's req/s and
p50, and the gateway process's user + system CPU per request served (the figure least moved by
the load generator sharing the CPUs). The report gives the per-round rows, the medians and, per metric,
the median of the per-round after/before ratios with a 95% bootstrap interval over rounds (SciPy):
an interval that includes 1.0 is "no difference resolved". ``--together`` loads both gateways in the same
window instead (each with its own wrk), so the machine's speed changes fall on both alike; with ``--pin CPU``
both run on that one CPU (this VM's two CPUs change speed apart from each other, by up to 1.5x).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from scipy import stats

from bench.gateway import BIN, REPO, ensure_wrk, measure, wrk
from bench.processes import free_port, running
from bench.serve.arms import without_gates

METRICS = (("rps", "req/s", "higher"), ("p50_ms", "p50 ms", "lower"), ("cpu_us_per_req", "CPU us/req", "lower"))


def policy_text(source: Path, worker: str) -> str:
    """The policy both gateways run: ``source`` with its worker URL pointed at the instant worker and its
    rollout gates stripped (this measures rolled-out pairs; an older tree may not know ``gates:``)."""
    return without_gates(source.read_text()).replace("http://127.0.0.1:30000", worker)


@contextlib.contextmanager
def gateway(tree: Path, policy: Path, log: Path) -> Iterator[tuple[str, int]]:
    """specgate's gateway run from ``tree`` (first on PYTHONPATH); yields (chat URL, process id)."""
    port = free_port()
    # the tree's own CLI: `cli` since the CLI became its own part, `gateway.cli` before (the installed console
    # script would import this checkout's CLI over the other tree's gateway; -P: the working directory is not on sys.path)
    module = "cli" if (tree / "cli" / "__init__.py").exists() else "gateway.cli"
    with running([str(BIN / "python"), "-P", "-c", f"import sys; from {module} import main; sys.exit(main())", "serve",
                  "--policy", str(policy), "--port", str(port), "--log-level", "warning"],
                 f"http://127.0.0.1:{port}/ready", log, env={"PYTHONPATH": str(tree.resolve())}) as proc:
        yield f"http://127.0.0.1:{port}/v1/chat/completions", proc.pid


def measure_together(sides: dict[str, tuple[str, int]], body: dict, concurrency: int, duration: float,
                     tmp: Path) -> dict[str, dict[str, float]]:
    """Both gateways loaded in the same window, each by its own wrk (``--together``): a change of the machine's
    speed mid-window falls on both alike, which back-to-back windows cannot promise on a VM whose speed
    flips within seconds. Each side's CPU per request is its own process's over that window."""
    with ThreadPoolExecutor(len(sides)) as pool:
        futures = {}
        for name, (url, pid) in sides.items():
            (tmp / name).mkdir(exist_ok=True)  # wrk's script file, one per side
            futures[name] = pool.submit(measure, url, pid, body, concurrency, duration, tmp / name)
        return {name: future.result() for name, future in futures.items()}


def ratio_summary(before: list[float], after: list[float], seed: int = 0) -> dict[str, float]:
    """Median of the paired after/before ratios and a 95% bootstrap interval of that median over rounds."""
    ratios = np.asarray(after, dtype=float) / np.asarray(before, dtype=float)
    if len(ratios) < 2:
        return {"median": float(ratios[0]), "low": float("nan"), "high": float("nan")}
    ci = stats.bootstrap((ratios,), np.median, confidence_level=0.95, n_resamples=5000,
                         method="percentile", random_state=seed).confidence_interval
    return {"median": float(np.median(ratios)), "low": float(ci.low), "high": float(ci.high)}


def report(rows: list[dict], concurrencies: list[int]) -> str:
    lines = ["| round | first | c | before req/s | after req/s | before p50 ms | after p50 ms | "
             "before CPU us/req | after CPU us/req |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        b, a = r["before"], r["after"]
        lines.append(f"| {r['round']} | {r['first']} | {r['concurrency']} | {b['rps']:.1f} | {a['rps']:.1f} | "
                     f"{b['p50_ms']:.2f} | {a['p50_ms']:.2f} | {b['cpu_us_per_req']:.0f} | "
                     f"{a['cpu_us_per_req']:.0f} |")
    lines += ["", "| c | metric | before median | after median | after/before (median of rounds) | 95% interval |",
              "|---:|---|---:|---:|---:|---|"]
    for c in concurrencies:
        mine = [r for r in rows if r["concurrency"] == c]
        for key, label, _ in METRICS:
            b = [r["before"][key] for r in mine]
            a = [r["after"][key] for r in mine]
            s = ratio_summary(b, a)
            lines.append(f"| {c} | {label} | {statistics.median(b):.2f} | {statistics.median(a):.2f} | "
                         f"{s['median']:.3f} | {s['low']:.3f}-{s['high']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the earlier commit")
    parser.add_argument("--after", type=Path, default=REPO, help="checkout of the later commit (default: this one)")
    parser.add_argument("--policy", type=Path, default=REPO / "deploy/policies/default.yaml",
                        help="policy both gateways run (an older tree may refuse today's default)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--stream", action="store_true", help="streamed chat completions (usage included)")
    parser.add_argument("--together", action="store_true",
                        help="load both gateways at once, each with its own wrk, instead of one after the other (ABBA)")
    parser.add_argument("--pin", type=int, default=None, metavar="CPU",
                        help="with --together: run both gateways on this one CPU, so they share its speed at every "
                             "instant (a VM's CPUs change speed apart from each other)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    parser.add_argument("--markdown", type=Path, default=None, help="write the tables as Markdown")
    args = parser.parse_args()
    if args.pin is not None and not args.together:
        parser.error("--pin needs --together: gateways measured one after the other may run on the CPU alone")
    ensure_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-compare-"))
    port = free_port()
    worker = f"http://127.0.0.1:{port}"
    policy = tmp / "policy.yaml"
    policy.write_text(policy_text(args.policy, worker))
    body = {"model": "instant", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
    if args.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(running([sys.executable, "-m", "bench.instant_worker", "--port", str(port)],
                                    f"{worker}/health", tmp / "instant.log"))
        sides = {name: stack.enter_context(gateway(tree, policy, tmp / f"gateway-{name}.log"))
                 for name, tree in (("before", args.before), ("after", args.after))}
        if args.pin is not None:
            for _, pid in sides.values():
                os.sched_setaffinity(pid, {args.pin})
        for url, _ in sides.values():
            wrk(url, body, 1, 2, tmp)  # warm-up: connections, caches, the learner's first snapshot
        for round_ in range(1, args.rounds + 1):
            order = ("before", "after") if round_ % 4 in (1, 0) else ("after", "before")  # ABBA
            for c in args.concurrency:
                row: dict = {"round": round_, "first": "together" if args.together else order[0], "concurrency": c}
                if args.together:
                    row.update(measure_together(sides, body, c, args.duration, tmp))
                else:
                    for name in order:
                        url, pid = sides[name]
                        row[name] = measure(url, pid, body, c, args.duration, tmp)
                rows.append(row)
                print(f"  round {round_:2} c={c:<3} " + "  ".join(
                    f"{name} {row[name]['rps']:8.1f} req/s {row[name]['cpu_us_per_req']:5.0f} us/req"
                    for name in ("before", "after")), flush=True)
    text = report(rows, args.concurrency)
    print("\n" + text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
