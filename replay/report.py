"""What ``specgate replay`` prints and writes: per load and slice, each contender's latency percentiles,
throughput, SLO goodput, accept length and decisions, and paired TPOT ratios with 95% intervals.

A ratio compares two contenders on the same requests (paired by request, geometric mean of TPOT ratios),
which removes the variation between prompts. Its interval is over seeds (Student t on the per-seed log
ratios) when the ratio varies between seeds; when it does not (a seedless pair: fixed arms at closed-loop
loads in by-slice order), the interval is over requests, as the serving benchmark's paired ratio. Every
figure of a cell with sampled requests is marked estimated (``~``): their rounds were drawn, not replayed.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

from replay.sim import Served

ALL = "all"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _t(df: int) -> float:
    from scipy import stats  # about 1.4 s: the gateway loads replay

    return float(stats.t.ppf(0.975, df))


def interval(xs: Sequence[float]) -> tuple[float, float, float]:
    """Mean and 95% Student-t interval (the mean itself twice for fewer than two values or no spread)."""
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, mean, mean
    sd = statistics.stdev(xs)
    half = _t(len(xs) - 1) * sd / math.sqrt(len(xs)) if sd > 0 else 0.0
    return mean, mean - half, mean + half


def cell(served: Sequence[Served], slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """One (contender, load, seed, slice) cell's figures."""
    if not served:
        return {"requests": 0}
    tpot = [s.tpot for s in served if s.tpot is not None]
    ttft = [s.ttft for s in served]
    span = max(s.arrival + s.e2e for s in served) - min(s.arrival for s in served)
    tokens = sum(s.tokens for s in served)
    met = sum(1 for s in served if s.ttft <= slo_ttft_s and (s.tpot is None or s.tpot <= slo_tpot_s))
    rounds = sum(s.verify_ct for s in served)
    speculative = [s for s in served if s.choice.option.proposer != "none"]
    spec_rounds = sum(s.verify_ct for s in speculative)
    return {
        "requests": len(served),
        "tpot_ms": {f"p{q}": _ms(percentile(tpot, q)) for q in (50, 90, 99)},
        "ttft_ms": {f"p{q}": _ms(percentile(ttft, q)) for q in (50, 90, 99)},
        "output_tok_s": tokens / span if span > 0 else None,
        "goodput_rps": met / span if span > 0 else None,
        "slo_met": met,
        "accept_length": (sum(s.accepted for s in speculative) + spec_rounds) / spec_rounds if spec_rounds else None,
        "tokens_per_round": tokens / rounds if rounds else None,
        "choices": dict(Counter(s.choice.label for s in served).most_common()),
        "explorations": sum(1 for s in served if s.choice.exploration is not None),
        "estimated": sum(1 for s in served if s.choice.estimated),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def paired_logs(a: Sequence[Served], b: Sequence[Served]) -> list[float]:
    """log(TPOT a / TPOT b) per request both served (by request index)."""
    other = {s.index: s.tpot for s in b if s.tpot}
    return [math.log(s.tpot / other[s.index]) for s in a if s.tpot and other.get(s.index)]


def split(results: dict, slice_of) -> dict:
    """(contender, load, seed) -> slice -> its served requests (``ALL``: every one), grouped once."""
    out = {}
    for key, served in results.items():
        groups: dict[str, list[Served]] = defaultdict(list)
        for s in served:
            groups[slice_of(s.index)].append(s)
        groups[ALL] = list(served)
        out[key] = groups
    return out


def ratio(groups: dict, a: str, b: str, load: str, slice_: str, seeds: int) -> dict | None:
    """Geometric-mean TPOT ratio of ``a`` over ``b`` in one (load, slice), with its 95% interval
    (``groups``: :func:`split`)."""
    per_seed, pooled = [], []
    for seed in range(seeds):
        logs = paired_logs(groups[(a, load, seed)].get(slice_, []), groups[(b, load, seed)].get(slice_, []))
        if logs:
            per_seed.append(statistics.fmean(logs))
            pooled.append(logs)
    if not per_seed:
        return None
    if len(per_seed) >= 2 and max(per_seed) - min(per_seed) > 1e-12:
        mean, lo, hi = interval(per_seed)
        over = "seeds"
    else:
        mean, lo, hi = interval(pooled[0])
        over = "requests"
    return {"ratio": math.exp(mean), "low": math.exp(lo), "high": math.exp(hi), "over": over,
            "pairs": len(pooled[0])}


def comparisons(contenders: Sequence[str], policies: Sequence[str]) -> list[tuple[str, str]]:
    """Which ratios to report: every contender against plain (if replayed), every policy against every arm
    and against the policies named before it."""
    pairs = [(name, "plain") for name in contenders if name != "plain" and "plain" in contenders]
    arms = [name for name in contenders if name not in policies and name != "plain"]
    for n, policy in enumerate(policies):
        pairs += [(policy, arm) for arm in arms] + [(policy, other) for other in policies[:n]]
    return pairs


def summarise(results: dict, contenders: Sequence[str], loads: Sequence[str], seeds: int, slice_of,
              slices: Sequence[str], slo: tuple[float, float], pairs: Sequence[tuple[str, str]] = ()) -> dict:
    """Cells averaged over seeds (mean of each figure, and its interval for TPOT p50 and goodput), and the
    paired ratios of ``pairs`` (:func:`comparisons`) in every load and slice."""
    out: dict = {"cells": defaultdict(dict), "ratios": []}
    groups = split(results, slice_of)
    for load in loads:
        for slice_ in (*slices, ALL):
            for a, b in pairs:
                r = ratio(groups, a, b, load, slice_, seeds)
                if r is not None:
                    out["ratios"].append({"a": a, "b": b, "load": load, "slice": slice_, **r})
    for name in contenders:
        for load in loads:
            for slice_ in (*slices, ALL):
                per_seed = []
                for seed in range(seeds):
                    per_seed.append(cell(groups[(name, load, seed)].get(slice_, []), *slo))
                out["cells"][f"{name}|{load}"][slice_] = _merge(per_seed)
    return out


def _merge(cells: list[dict]) -> dict:
    """The seed-mean of every numeric figure; ``*_ci`` for TPOT p50 and goodput; choices summed."""
    first = cells[0]
    if not first.get("requests"):
        return first
    merged: dict = {"requests": first["requests"], "seeds": len(cells)}
    for key in ("tpot_ms", "ttft_ms"):
        merged[key] = {q: _mean([c[key][q] for c in cells]) for q in first[key]}
    for key in ("output_tok_s", "goodput_rps", "slo_met", "accept_length", "tokens_per_round", "explorations",
                "estimated"):
        merged[key] = _mean([c[key] for c in cells])
    for key, path in (("tpot_p50_ci", ("tpot_ms", "p50")), ("goodput_ci", ("goodput_rps",))):
        values = [c[path[0]][path[1]] if len(path) == 2 else c[path[0]] for c in cells]
        values = [v for v in values if v is not None]
        merged[key] = list(interval(values)[1:]) if values else None
    choices: Counter = Counter()
    for c in cells:
        choices.update(c["choices"])
    merged["choices"] = dict(choices.most_common())
    return merged


def _mean(values: list) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.fmean(xs) if xs else None


def _f(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(summary: dict, meta: dict, contenders: Sequence[str], loads: Sequence[str], slices: Sequence[str],
             plots: Sequence[Path] = ()) -> str:
    lines = [f"# specgate replay: {meta['trace']}", "",
             f"{meta['requests']} requests ({meta['estimated']} sampled: their figures are estimated, marked ~), "
             f"mix {meta['mix']}, {meta['seeds']} seeds, cost model {meta['costs']}, "
             f"SLO TTFT {meta['slo_ms'][0]:g} ms / TPOT {meta['slo_ms'][1]:g} ms."
             + (f" Command: `{meta['command']}`" if meta.get("command") else ""), ""]
    for load in loads:
        for slice_ in (*slices, ALL):
            lines += [f"## {load} / {slice_}", "",
                      "| contender | TPOT p50 ms [95%] | p90 | p99 | TTFT p50 ms | p90 | p99 | tok/s | goodput r/s "
                      "| accept len | decisions |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            for name in contenders:
                c = summary["cells"][f"{name}|{load}"][slice_]
                if not c.get("requests"):
                    continue
                mark = "~" if c["estimated"] else ""
                ci = c["tpot_p50_ci"]
                span = f" [{ci[0]:.1f}, {ci[1]:.1f}]" if ci and ci[1] - ci[0] > 1e-9 else ""
                choices = ", ".join(f"{k} {v / c['seeds']:.3g}" for k, v in list(c["choices"].items())[:4])
                lines.append(f"| {name} | {mark}{_f(c['tpot_ms']['p50'])}{span} | {_f(c['tpot_ms']['p90'])} | "
                             f"{_f(c['tpot_ms']['p99'])} | {_f(c['ttft_ms']['p50'], '.0f')} | "
                             f"{_f(c['ttft_ms']['p90'], '.0f')} | {_f(c['ttft_ms']['p99'], '.0f')} | "
                             f"{_f(c['output_tok_s'], '.2f')} | {_f(c['goodput_rps'], '.3f')} | "
                             f"{mark}{_f(c['accept_length'], '.2f')} | {choices} |")
            rows = [r for r in summary["ratios"] if r["load"] == load and r["slice"] == slice_]
            if rows:
                lines += ["", "| TPOT ratio (paired, geomean) | ratio | 95% interval | over | pairs |",
                          "|---|---|---|---|---|"]
                lines += [f"| {r['a']} / {r['b']} | {r['ratio']:.3f} | {r['low']:.3f}, {r['high']:.3f} | {r['over']} "
                          f"| {r['pairs']} |" for r in rows]
            lines.append("")
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def plots(summary: dict, contenders: Sequence[str], loads: Sequence[str], slices: Sequence[str], out: Path
          ) -> list[Path]:
    """TPOT p50 and goodput against load, one panel per slice, one line per contender (as ``specgate bench
    serve`` draws them). Needs matplotlib (``pip install matplotlib``); without it, no plots and a note."""
    try:
        import matplotlib  # optional, about 1 s: only plots need it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # see above
    except ImportError:
        return []
    paths = []
    panels = (*slices, ALL)
    for metric, key, unit in (("tpot", ("tpot_ms", "p50"), "TPOT p50 (ms)"), ("goodput", ("goodput_rps",), "goodput (req/s)")):
        fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), squeeze=False)
        for ax, slice_ in zip(axes[0], panels):
            for name in contenders:
                ys = []
                for load in loads:
                    c = summary["cells"][f"{name}|{load}"][slice_]
                    v = c.get(key[0]) if c.get("requests") else None
                    ys.append(v[key[1]] if isinstance(v, dict) else v)
                ax.plot(list(loads), [math.nan if y is None else y for y in ys], marker="o", label=name)
            ax.set_title(slice_)
            ax.set_xlabel("load")
        axes[0][0].set_ylabel(unit)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        path = out / f"replay-{metric}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths
