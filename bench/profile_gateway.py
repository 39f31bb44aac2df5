"""Where the gateway's CPU goes: specgate's gateway (one process) in front of the instant worker under wrk load,
sampled by py-spy (a dev dependency); prints the share of samples per function (its own lines, and with what it
calls) and per file.

    .venv/bin/python -m bench.profile_gateway --concurrency 32 --duration 20 [--top 40] [--raw FILE] [--otel-sample 0.1]
    .venv/bin/python -m bench.profile_gateway --otel-sample 1 --exporter      # the trace exporter process instead

The shares are of the samples py-spy took of the gateway's Python threads while they ran (idle waits are not
sampled); a share is a direction, not a figure to quote: a change is measured with ``bench.gateway_compare``
(before against after, side by side). py-spy reads the process from outside (ptrace), so the gateway runs
unmodified; the sampling itself takes some of the machine's CPU, so req/s here is lower than ``bench.gateway``'s.
``--otel-sample``: OpenTelemetry trace export on, that share of requests sampled, to ``bench/otlp_sink.py``
(``bench.gateway``'s ``specgate-otel`` arm; both start their gateways with ``bench.gateway.gateways``).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.gateway import BIN, ensure_wrk, gateways, wrk
from bench.processes import free_port, running

_LINE = re.compile(r":\d+\)$")  # py-spy's frame "function (file:line)": the line dropped, the function kept
_FILE = re.compile(r"\((.*):\d+\)$")
_SITE = re.compile(r"^.*/site-packages/")


def shares(lines: list[str], top: int) -> dict[str, list[tuple[str, float]]]:
    """py-spy's raw (collapsed) stacks, ``frame;frame;... count`` a line, outermost first, as shares of all samples:
    ``self`` per innermost function, ``inclusive`` per function anywhere on the stack (once per stack), ``file``
    per innermost frame's file (site-packages paths shortened)."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    files: collections.Counter[str] = collections.Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), [_LINE.sub(")", f) for f in stack.split(";")]
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
        where = _FILE.search(stack.split(";")[-1])
        files[_SITE.sub("", where.group(1)) if where else frames[-1]] += n
    if not total:
        return {"self": [], "inclusive": [], "file": []}
    return {name: [(key, n / total) for key, n in counter.most_common(top)]
            for name, counter in (("self", own), ("inclusive", inclusive), ("file", files))}


def report(table: dict[str, list[tuple[str, float]]]) -> str:
    titles = {"self": "own lines", "inclusive": "with what it calls", "file": "by file (own lines)"}
    out = []
    for name, rows in table.items():
        out.append(f"\n== share of samples, {titles[name]}")
        out += [f"{share * 100:5.1f}%  {key}" for key, share in rows]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds sampled under load")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=40, help="rows per table")
    parser.add_argument("--raw", type=Path, default=None, help="also keep py-spy's raw stacks here")
    parser.add_argument("--otel-sample", type=float, default=None,
                        help="trace export on, this share of requests sampled (default: off)")
    parser.add_argument("--exporter", action="store_true",
                        help="sample the gateway's trace exporter process instead (needs --otel-sample)")
    args = parser.parse_args()
    if args.exporter and args.otel_sample is None:
        parser.error("--exporter profiles the trace exporter process: give --otel-sample too")
    spy = shutil.which("py-spy", path=str(BIN)) or shutil.which("py-spy")
    if spy is None:
        sys.exit("error: py-spy is not installed; `pip install -e '.[dev]'` installs it (pinned in pyproject.toml)")
    ensure_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    raw = args.raw or tmp / "raw.txt"
    body = {"model": "instant", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
    port = free_port()
    worker = f"http://127.0.0.1:{port}"
    arm = "specgate" if args.otel_sample is None else "specgate-otel"
    with running([sys.executable, "-m", "bench.instant_worker", "--port", str(port)], f"{worker}/health",
                 tmp / "instant.log"), \
            gateways(worker, "instant", tmp, [arm], otel_sample=1.0 if args.otel_sample is None else args.otel_sample) as (urls, pids, _):
        url = urls[arm]
        wrk(url, body, args.concurrency, 3, tmp)  # warm-up: connections, caches, the learner's first cells
        pid = pids[arm]
        if args.exporter:  # the gateway's one child process (telemetry/otel_export.py)
            [child] = psutil.Process(pid).children()
            pid = child.pid
        sampler = subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", str(args.rate),
                                    "--duration", str(round(args.duration)), "--format", "raw",
                                    "--output", str(raw), "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)  # py-spy attached before the window starts
        load = wrk(url, body, args.concurrency, max(1.0, args.duration - 1), tmp)
        _, err = sampler.communicate(timeout=args.duration + 60)
    if sampler.returncode != 0 or not raw.exists():
        sys.exit(f"error: py-spy failed (it needs ptrace: root, or CAP_SYS_PTRACE in a container): {err.strip()}")
    print(f"c={args.concurrency}: {load['rps']:.0f} req/s while sampled, py-spy {args.rate} Hz for "
          f"{args.duration:g} s; raw stacks: {raw}")
    print(report(shares(raw.read_text().splitlines(), args.top)))


if __name__ == "__main__":
    main()
