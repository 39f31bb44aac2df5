"""bench.gateway's report: medians per arm over the rounds, arms paired round by round, and the Markdown table
(the arms' runs are bench/gateway.py's)."""

from __future__ import annotations

import statistics


def medians(rows: list[dict]) -> list[dict]:
    """One row per (worker, via, concurrency): each figure's median over the rounds (non-2xx: their sum)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["worker"], r["via"], r["concurrency"]), []).append(r)
    return [{"worker": w, "via": v, "concurrency": c, "rounds": len(g),
             **{k: statistics.median(r.get(k, float("nan")) for r in g) for k in ("rps", "p50_ms", "p99_ms", "cpu_us_per_req",
                                                                          "child_cpu_us_per_req")},
             "non_2xx": sum(r["non_2xx"] for r in g)} for (w, v, c), g in groups.items()]


def against(rows: list[dict], ours: str, theirs: str, concurrency: int, low: int) -> str:
    """Per-round comparisons of ``ours`` with ``theirs`` in front of the instant worker: req/s ratio at
    ``concurrency``, and the difference of their added p50 (over direct) at ``low``: median [min, max] of rounds."""
    by = {(r["via"], r["concurrency"], r["round"]): r for r in rows if r["worker"] == "instant"}
    rounds = sorted({r["round"] for r in rows})
    ratios = [by[ours, concurrency, n]["rps"] / by[theirs, concurrency, n]["rps"] for n in rounds
              if (ours, concurrency, n) in by and (theirs, concurrency, n) in by]
    gaps = [by[ours, low, n]["p50_ms"] - by[theirs, low, n]["p50_ms"] for n in rounds
            if (ours, low, n) in by and (theirs, low, n) in by]
    if not ratios or not gaps:
        return ""

    def spread(xs: list[float], fmt: str) -> str:
        return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}, {max(xs):{fmt}}]"
    return (f"\n{ours} / {theirs} over {len(ratios)} rounds, median [min, max]: req/s at c={concurrency} "
            f"{spread(ratios, '.3f')}x; p50 at c={low} {spread(gaps, '+.3f')} ms over {theirs}'s")


def table(all_rows: list[dict], env: dict[str, str]) -> str:
    """The Markdown report: a row per arm and concurrency (medians over the rounds), then the comparisons."""
    rows = medians(all_rows)
    lines = ["```", *(f"{k}: {v}" for k, v in env.items()), "```", "",
             "| worker | via | c | req/s | p50 ms | p99 ms | added p50 ms | gateway CPU us/req | of it, child "
             "processes | non-2xx |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    direct = {(r["worker"], r["concurrency"]): r for r in rows if r["via"] == "direct"}
    for r in rows:
        base = direct.get((r["worker"], r["concurrency"]))
        added = r["p50_ms"] - base["p50_ms"] if base and r["via"] != "direct" else 0.0
        lines.append(f"| {r['worker']} | {r['via']} | {r['concurrency']} | {r['rps']:.1f} | {r['p50_ms']:.2f} | "
                     f"{r['p99_ms']:.2f} | {added:+.2f} | {r.get('cpu_us_per_req', float('nan')):.0f} | "
                     f"{r.get('child_cpu_us_per_req', float('nan')):.0f} | {r['non_2xx']} |")
    by = {(r["worker"], r["via"], r["concurrency"]): r for r in rows}
    top = max(c for _, _, c in by)
    ours = by.get(("instant", "specgate", top))
    for c in sorted({c for _, _, c in by}):
        off, on = by.get(("instant", "specgate", c)), by.get(("instant", "specgate-otel", c))
        if off and on:
            lines.append(f"\ntracing on ({env.get('otel_sample', '1')} sampled) / off at c={c}: "
                         f"req/s {on['rps'] / off['rps']:.3f}x, "
                         f"p50 {on['p50_ms'] - off['p50_ms']:+.3f} ms")
    if counted := next((r for r in all_rows if "spans_exported" in r), None):
        lines.append(f"\nspans the sink received from specgate-otel: {counted['spans_exported']} for "
                     f"{counted['requests_counted']} requests it served, warm-up included "
                     f"({counted['spans_exported'] / max(1, counted['requests_counted']):.2f} per request; a sampled "
                     f"request has 5); requests whose spans the gateway dropped: {counted.get('traces_dropped', 0)}")
    for other in ("litellm", "smg"):
        theirs = by.get(("instant", other, top))
        if ours and theirs:
            lines.append(f"\nspecgate / {other} req/s at c={top} (instant worker): "
                         f"{ours['rps'] / theirs['rps']:.2f}x")
    if len({r["round"] for r in all_rows}) > 1 and "specgate-otel" in {r["via"] for r in all_rows}:
        lines.append(against(all_rows, "specgate-otel", "specgate", top, min(c for _, _, c in by)))
    if len({r["round"] for r in all_rows}) > 1 and "smg" in {r["via"] for r in all_rows}:
        low = min(c for _, _, c in by)
        lines += [line for arm in dict.fromkeys(r["via"] for r in all_rows) if arm.startswith("specgate")
                  if (line := against(all_rows, arm, "smg", top, low))]
    return "\n".join(lines)
