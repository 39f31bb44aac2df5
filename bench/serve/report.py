"""The result file as a markdown report and PNG plots (TPOT and goodput vs load, one panel per slice,
one line per arm)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from scipy import stats

from bench.serve.analyse import noise_by_load, repeats, same_config_cells, section


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _decisions(cell: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(cell["choices"].items()))


TPOT_TARGET = 1.03  # adaptive p50 TPOT <= 1.03x the best fixed arm's


def paired_tpot_ratio(requests: list[dict], arm: str, other: str, load: str, slice_: str | None,
                      between: tuple[float, int] | None = None, repeats: int = 1, field: str = "slice"
                      ) -> tuple[float, float, float, int] | None:
    """Geometric mean of ``arm``'s TPOT over ``other``'s on the same prompts of one cell, with a 95%
    confidence interval (Student t on the log ratios): (ratio, low, high, pairs), None under 2 pairs.
    ``slice_`` None: every slice's prompts of the load together; ``field``: the request's key ``slice_`` is
    matched against (``workload_slice``: the slice a request of an interleaved run came from).
    Pairing by prompt removes the variation between prompts, which dwarfs the one between arms; with
    ``--repeats`` each side of a pair is the geometric mean of the prompt's replicates.
    ``between`` = (variance, cells): the variance of a cell's mean log ratio between runs
    (:func:`bench.serve.analyse.noise_by_load`), added for loads where the cell's requests are not
    independent, divided by ``repeats`` (each side averages that many independent runs of the cell); the
    degrees of freedom by Welch-Satterthwaite. Bounds are NaN when ``between`` is needed but unknown
    (``(nan, 0)``)."""
    logs_of: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in requests:
        if (r["load"] == load and slice_ in (None, r.get(field)) and r["arm"] in (arm, other) and r["ok"]
                and r["tpot_s"]):
            logs_of[(r["arm"], r["item"])].append(math.log(r["tpot_s"]))
    mean_log = {key: statistics.fmean(xs) for key, xs in logs_of.items()}
    logs = [mean_log[(arm, item)] - x for (a, item), x in mean_log.items() if a == other and (arm, item) in mean_log]
    n = len(logs)
    if n < 2:
        return None
    mean = sum(logs) / n
    within = sum((x - mean) ** 2 for x in logs) / (n - 1) / n
    var_b, cells = between or (0.0, 0)
    if math.isnan(var_b):
        return math.exp(mean), math.nan, math.nan, n
    var_b /= repeats
    df = n - 1 if var_b <= 0 else (within + var_b) ** 2 / (within ** 2 / (n - 1) + var_b ** 2 / cells)
    half = stats.t.ppf(0.975, df) * math.sqrt(within + var_b)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half), n


def _verdict(ci: tuple[float, float, float, int] | None, bound: float) -> str:
    """Against an upper bound: met (the whole interval at or below), missed (the whole interval above),
    else open (this run cannot tell)."""
    if ci is None:
        return "-"
    ratio, low, high, _ = ci
    if math.isnan(low):
        return f"{ratio:.2f} [unsized] open"
    state = "met" if high <= bound else "missed" if low > bound else "open"
    return f"{ratio:.2f} [{low:.2f}, {high:.2f}] {state}"


def _adaptive_and_fixed(arms: dict) -> tuple[str | None, list[str]]:
    """The adaptive arm the report judges (warm if measured, else cold, else None) and the fixed arms."""
    adaptive = "adaptive-warm" if "adaptive-warm" in arms else "adaptive" if "adaptive" in arms else None
    return adaptive, [a for a in arms if not a.startswith("adaptive")]


def _targets(result: dict, noise: dict[str, tuple[float, int, bool]] | None = None) -> list[str]:
    """Adaptive (warm if measured, else cold) against the best fixed arm of each cell: the targets.
    ``noise``: the run's :func:`noise_by_load`, if the caller has it already."""
    arms = result["arms"]
    adaptive, fixed = _adaptive_and_fixed(arms)
    if adaptive is None or not fixed:
        return []
    lines = [f"\n**{adaptive} vs the best fixed arm per cell** (targets: goodput >= 0.97x best, "
             f"p50 TPOT <= {TPOT_TARGET}x best, goodput >= 1.0x plain). The paired columns compare TPOT prompt by "
             "prompt (geometric mean of the ratios, 95% interval): *met* / *missed* when the whole interval is on "
             f"one side of the bound ({TPOT_TARGET} against the best arm, 1.0 against plain), *open* when this run "
             "cannot tell; at concurrent loads the interval adds the between-run variance of a cell measured by "
             "the same-configuration cells below (*unsized* without two of them)\n",
             "| slice | load | best goodput (arm) | adaptive goodput | x best | best p50 TPOT (arm) | "
             "adaptive p50 TPOT | x best | paired TPOT x best | paired TPOT x plain | x plain goodput |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    requests = result.get("requests", [])
    noise = noise_by_load(result, same_config_cells(result)) if noise is None else noise
    reps = repeats(result)
    for load in result["settings"]["loads"]:
        between = noise[load][:2] if load in noise else None
        for slice_ in result["settings"]["slices"]:
            cells = {a: arms[a]["cells"][load][slice_] for a in fixed}
            ours = arms[adaptive]["cells"][load][slice_]
            g_arm = max(cells, key=lambda a: cells[a]["goodput_rps"] or 0)
            t_arm = min(cells, key=lambda a: cells[a]["tpot_ms"]["p50"] or float("inf"))
            g_best, t_best = cells[g_arm]["goodput_rps"] or 0, cells[t_arm]["tpot_ms"]["p50"]
            g, t = ours["goodput_rps"] or 0, ours["tpot_ms"]["p50"]
            plain_g = cells["plain"]["goodput_rps"] if "plain" in cells else None
            vs_best = _verdict(paired_tpot_ratio(requests, adaptive, t_arm, load, slice_, between, reps), TPOT_TARGET)
            vs_plain = (_verdict(paired_tpot_ratio(requests, adaptive, "plain", load, slice_, between, reps), 1.0)
                        if "plain" in cells else "-")
            lines.append(
                f"| {slice_} | {load} | {g_best:.3f} ({g_arm}) | {g:.3f} | {_fmt(g / g_best if g_best else None, '.2f')} "
                f"| {_fmt(t_best)} ({t_arm}) | {_fmt(t)} | {_fmt(t / t_best if t and t_best else None, '.2f')} "
                f"| {vs_best} | {vs_plain} | {_fmt(g / plain_g if plain_g else None, '.2f')} |")
    return lines


def _by_workload_slice(result: dict, noise: dict[str, tuple[float, int, bool]]) -> list[str]:
    """An interleaved run has one cell per load: the adaptive arm's paired TPOT over each fixed arm, per slice the
    requests came from (``workload_slice``), with the same intervals as the targets table."""
    adaptive, fixed = _adaptive_and_fixed(result["arms"])
    requests = result.get("requests", [])
    kinds = sorted({r.get("workload_slice") for r in requests} - {None})
    if result["settings"].get("mix") != "interleaved" or adaptive is None or not fixed or not kinds:
        return []
    lines = [f"\n**{adaptive}'s paired TPOT over each fixed arm, by the slice each request came from** (geometric "
             "mean [95% interval], as above)\n", "| load | over | all | " + " | ".join(kinds) + " |",
             "|---|---|---|" + "---|" * len(kinds)]
    reps = repeats(result)
    for load in result["settings"]["loads"]:
        between = noise[load][:2] if load in noise else None
        for other in fixed:
            cells = [paired_tpot_ratio(requests, adaptive, other, load, None, between, reps)] + [
                paired_tpot_ratio(requests, adaptive, other, load, kind, between, reps, field="workload_slice")
                for kind in kinds]
            lines.append(f"| {load} | {other} | " + " | ".join(_interval(ci) for ci in cells) + " |")
    return lines


def _interval(ci: tuple[float, float, float, int] | None) -> str:
    if ci is None:
        return "-"
    ratio, low, high, _ = ci
    return f"{ratio:.3f} [unsized]" if math.isnan(low) else f"{ratio:.3f} [{low:.2f}, {high:.2f}]"


def markdown(result: dict, plots: list[Path] | None = None) -> str:
    meta, settings = result["meta"], result["settings"]
    lines = [f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; CPU: {meta['cpu']} ({meta['cores']} cores); "
             f"specgate {meta['commit']}; python {meta['python']}, torch {meta['torch']}, "
             f"transformers {meta['transformers']}  ",
             f"SLO (default policy): TTFT <= {meta['slo']['ttft_ms']} ms, TPOT <= {meta['slo']['tpot_ms']} ms; "
             f"{settings['per_slice']} requests per slice, max_tokens {settings['max_tokens']}, greedy; "
             f"wall time {meta['wall_s']:.0f} s", ""]
    lines[-1:] = [f"**Note.** {note}" for note in meta.get("notes", [])] + [""]  # e.g. arms.tree_notes
    if meta.get("parts"):  # bench/serve/merge.py
        lines[-1:] = ["Merged from one run per load point (each with its own gateways and warm-up): "
                      + "; ".join(f"`{p['dir']}` ({p['date']}, {p['wall_s']:.0f} s)" for p in meta["parts"]), ""]
    for slice_ in settings["slices"]:
        lines += [f"\n**{slice_}**\n", "| arm | load | TTFT p50/p99 ms | TPOT p50/p90/p99 ms | tok/s | goodput r/s "
                  "| SLO att. | acc. len | decisions (pool:k) | = plain | peak RSS MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm, data in result["arms"].items():
            for load in settings["loads"]:
                c = data["cells"][load][slice_]
                same = "-" if c["compared_to_plain"] is None else f"{c['identical_to_plain']}/{c['compared_to_plain']}"
                ttft, tpot = c["ttft_ms"], c["tpot_ms"]
                lines.append(
                    f"| {arm} | {load} | {_fmt(ttft['p50'], '.0f')}/{_fmt(ttft['p99'], '.0f')} | "
                    f"{_fmt(tpot['p50'])}/{_fmt(tpot['p90'])}/{_fmt(tpot['p99'])} | {_fmt(c['output_tok_s'])} | "
                    f"{_fmt(c['goodput_rps'], '.3f')} | {_fmt(c['slo_attainment'], '.2f')} | "
                    f"{_fmt(c['accept_length'], '.2f')} | {_decisions(c)} | {same} | {_fmt(c['peak_rss_mb'], '.0f')} |")
    same = same_config_cells(result)
    noise = noise_by_load(result, same)
    lines += _targets(result, noise)
    lines += _by_workload_slice(result, noise)
    lines += section(result, same, noise)
    if result.get("learning_cost"):
        lines += ["\n**Cost of learning** (warm-up pass from a cold learner; requests counted over all slices, "
                  "in brackets the slice's own: until the slice's rolling TPOT over 3 requests came within 5% of "
                  "the warm arm's p50, and from when on every non-exploring decision was the warm arm's choice)\n",
                  "| slice | TPOT within 5% after | warm p50 TPOT ms | decisions settled from | warm choice |",
                  "|---|---|---|---|---|"]
        never = f"not within {sum(r['arm'] == 'adaptive-warm' for r in result['warmup'])}"
        for slice_, v in result["learning_cost"].items():
            n = f"{v['requests']} ({v['slice_requests']})" if v["requests"] is not None else never
            settled = (f"{v['settled']} ({v['settled_slice_requests']})" if v.get("settled") is not None
                       else never if "warm_choice" in v else "-")
            lines.append(f"| {slice_} | {n} | {_fmt(v['warm_tpot_p50_ms'])} | {settled} | {v.get('warm_choice') or '-'} |")
    for p in plots or ():
        lines.append(f"\n![{p.stem}]({p.name})")
    return "\n".join(lines) + "\n"


def plots(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib  # a dev dependency (about 1 s): only plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # see above

    settings, written = result["settings"], []
    loads, slices = settings["loads"], settings["slices"]
    for name, label, get in (("tpot", "p50 TPOT (ms)", lambda c: c["tpot_ms"]["p50"]),
                             ("goodput", "SLO goodput (requests/s)", lambda c: c["goodput_rps"])):
        fig, axes = plt.subplots(1, len(slices), figsize=(3.6 * len(slices), 3.4), squeeze=False)
        for ax, slice_ in zip(axes[0], slices):
            for arm, data in result["arms"].items():
                ys = [get(data["cells"][load][slice_]) for load in loads]
                ax.plot(range(len(loads)), [float("nan") if y is None else y for y in ys], marker="o", label=arm)
            ax.set_xticks(range(len(loads)), loads)
            ax.set_title(slice_)
            ax.set_xlabel("load (cN closed loop, pR Poisson r/s)")
        axes[0][0].set_ylabel(label)
        axes[0][-1].legend(fontsize=7)
        meta = result["meta"]
        fig.suptitle(f"{label} vs load - {meta['date']} - {meta['cpu']}", fontsize=9)
        fig.tight_layout()
        path = out_dir / f"serve-{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
