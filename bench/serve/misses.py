"""Why requests of a serving-benchmark run missed the SLO: by cause (TTFT, TPOT, both) per arm, slice and load,
and for each TTFT miss how many other prompts of the same cell were waiting for their first token meanwhile.

    specgate bench serve --misses RUN [--arms plain ngram-k4 ...]

RUN is a ``specgate bench serve`` result (serve.json or serve.json.gz); the SLO is the run's own
(``meta.slo``). A request waits for its first token from ``start_s`` to ``start_s + ttft_s``; another
request of the same arm, load and repeat whose wait overlaps it is *prefilling alongside* (on the embedded
engine: sharing the steps' prefill budget). A goodput gap between two arms that comes from TTFT misses with
prompts prefilling alongside is the run's arrival timing, which changes with every arm's speed, not the
decoding the arms differ in.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path


def misses(requests: list[dict], slo: dict) -> dict[tuple[str, str, str], dict[str, int]]:
    """Per (arm, load, slice): requests, misses by TTFT only, by TPOT only, by both, and the TTFT misses that
    had another prompt of their cell waiting for its first token at the same time. ``slo``: ``ttft_ms`` and
    ``tpot_ms`` (None: not a bound)."""
    ttft_bound = slo.get("ttft_ms")
    tpot_bound = slo.get("tpot_ms")
    waits: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for r in requests:
        if r.get("ok") and r.get("ttft_s") is not None:
            waits[(r["arm"], r["load"], r.get("rep", 0))].append((id(r), r["start_s"], r["start_s"] + r["ttft_s"]))
    out: dict[tuple[str, str, str], dict[str, int]] = {}
    for r in requests:
        if not r.get("ok"):
            continue
        key = (r["arm"], r["load"], r.get("workload_slice") or r["slice"])
        row = out.setdefault(key, {"requests": 0, "ttft": 0, "tpot": 0, "both": 0, "alongside": 0})
        row["requests"] += 1
        late = ttft_bound is not None and r["ttft_s"] * 1e3 > ttft_bound
        slow = tpot_bound is not None and r.get("tpot_s") is not None and r["tpot_s"] * 1e3 > tpot_bound
        if late or slow:
            row["both" if late and slow else "ttft" if late else "tpot"] += 1
        if late:
            start, first = r["start_s"], r["start_s"] + r["ttft_s"]
            others = sum(1 for who, s, f in waits[(r["arm"], r["load"], r.get("rep", 0))]
                         if who != id(r) and s < first and f > start)
            row["alongside"] += others > 0
    return out


def report(path: Path, arms: list[str] | None = None) -> int:
    """Print the table of ``misses`` for the run at ``path`` (``arms``: those shown, default every arm of the run);
    2 with a message naming what to fix when an arm is not in the run."""
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    run = json.loads(raw)
    arms = arms or run["settings"]["arms"]
    unknown = [a for a in arms if a not in run["settings"]["arms"]]
    if unknown:
        print(f"error: --arms {unknown[0]!r} is not in the run (it has: {', '.join(run['settings']['arms'])})",
              file=sys.stderr)
        return 2
    slo = run["meta"]["slo"]
    table = misses(run["requests"], slo)
    print(f"SLO: TTFT <= {slo.get('ttft_ms')} ms, TPOT <= {slo.get('tpot_ms')} ms. Misses by cause; 'alongside': "
          "TTFT misses while another prompt of the cell waited for its first token")
    print("| arm | load | slice | requests | met | TTFT only | TPOT only | both | TTFT misses alongside |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for arm in arms:
        for load in run["settings"]["loads"]:
            keys = sorted(k for k in table if k[0] == arm and k[1] == load)
            total = {"requests": 0, "ttft": 0, "tpot": 0, "both": 0, "alongside": 0}
            for key in keys:
                row = table[key]
                for name in total:
                    total[name] += row[name]
                print(_row(arm, load, key[2], row))
            if len(keys) > 1:
                print(_row(arm, load, "all", total))
    return 0


def _row(arm: str, load: str, slice_: str, row: dict[str, int]) -> str:
    met = row["requests"] - row["ttft"] - row["tpot"] - row["both"]
    return (f"| {arm} | {load} | {slice_} | {row['requests']} | {met} | {row['ttft']} | {row['tpot']} | "
            f"{row['both']} | {row['alongside']} |")
