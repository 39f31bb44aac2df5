"""What a result file says about its own noise, and what a bigger run would cost: computed from
``serve.json`` alone, so every figure quoted from a run can be recomputed with ``--report DIR``.

- **Same-configuration comparisons** (A/A): two arms of one cell that served the same pool:k on a prompt
  (an adaptive arm and the fixed arm of its choice, or both adaptive arms), or with ``--repeats`` one arm's
  two replicates of the cell, and answered it identically.
  Their TPOT ratio should be 1; how far it strays is the run's noise. Per request (the median and spread
  per load point) and per cell (cells where both arms served that one configuration on every request).
- **Run-to-run noise under concurrency**: at a concurrent load point each arm serves a whole cell in turn,
  so its requests share that stretch of the machine's speed and are not independent; a paired interval
  over them is too narrow. The same-configuration cells measure the missing part, the variance of a
  cell's mean log ratio between two runs of one configuration, and :func:`between_cells_variance`
  estimates it for widening the intervals at those loads.
- **Duration estimate** of a larger preset, from this run's cell wall times.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from bench.serve.presets import PRESETS


def sequential(load: str) -> bool:
    """One request at a time (c1): arms take turns per request, the requests are close to independent."""
    return load == "c1"


@dataclass(frozen=True)
class SameConfigCell:
    load: str
    slice: str
    arms: tuple[str, str]
    config: str
    logs: tuple[float, ...]  # log TPOT ratio per prompt, arms[0] over arms[1]

    @property
    def ratio(self) -> float:
        return math.exp(statistics.fmean(self.logs))


def repeats(result: dict) -> int:
    """How many times every arm served every cell (``--repeats``; runs before it: 1)."""
    return result["settings"].get("repeats", 1)


def _by_arm(result: dict) -> dict[tuple[str, str, str, int], dict[str, dict]]:
    """(load, slice, arm, replicate) -> item -> request, ok requests with a TPOT only."""
    out: dict[tuple[str, str, str, int], dict[str, dict]] = defaultdict(dict)
    for r in result.get("requests", []):
        if r["ok"] and r["tpot_s"]:
            out[(r["load"], r["slice"], r["arm"], r.get("rep", 0))][r["item"]] = r
    return out


def _config(r: dict) -> str:
    return f"{r['pool']}:{r['draft_tokens']}"


def _pairs(result: dict) -> list[tuple[str, str]]:
    """Arm pairs that can serve the same configuration: each adaptive arm with every other arm."""
    arms = list(result["arms"])
    return [(a, b) for a in arms if a.startswith("adaptive") for b in arms
            if b != a and not (b.startswith("adaptive") and b < a)]


def _arm_pairs(result: dict) -> Iterator[tuple[str, str, tuple[str, str], dict[str, dict], dict[str, dict]]]:
    """(load, slice, arms, requests of arms[0], requests of arms[1]) for every cell: every arm pair of
    :func:`_pairs` within each replicate, and with ``--repeats`` every arm against its own previous
    replicate (``arms = (arm, arm)``, the later over the earlier); requests keyed by item. The walk both
    kinds of same-configuration comparison share."""
    by_arm = _by_arm(result)
    reps = repeats(result)
    for load in result["settings"]["loads"]:
        for slice_ in result["settings"]["slices"]:
            for rep in range(reps):
                for a, b in _pairs(result):
                    yield (load, slice_, (a, b), by_arm.get((load, slice_, a, rep), {}),
                           by_arm.get((load, slice_, b, rep), {}))
            for rep in range(1, reps):
                for a in result["arms"]:
                    yield (load, slice_, (a, a), by_arm.get((load, slice_, a, rep), {}),
                           by_arm.get((load, slice_, a, rep - 1), {}))


def _same(r: dict, o: dict | None) -> bool:
    return o is not None and _config(r) == _config(o) and r["text"] == o["text"]


def same_config_requests(result: dict) -> list[tuple[str, str, tuple[str, str], float]]:
    """(load, slice, arms, log TPOT ratio) for every prompt two arms served with the same pool:k and the
    same text."""
    return [(load, slice_, arms, math.log(r["tpot_s"] / theirs[item]["tpot_s"]))
            for load, slice_, arms, mine, theirs in _arm_pairs(result)
            for item, r in mine.items() if _same(r, theirs.get(item))]


def same_config_cells(result: dict) -> list[SameConfigCell]:
    """Cells where two arms served one configuration on every prompt (at least two), identically."""
    out = []
    for load, slice_, arms, mine, theirs in _arm_pairs(result):
        configs = {_config(r) for r in (*mine.values(), *theirs.values())}
        if len(mine) < 2 or mine.keys() != theirs.keys() or len(configs) != 1:
            continue
        if all(_same(mine[i], theirs[i]) for i in mine):
            logs = tuple(math.log(mine[i]["tpot_s"] / theirs[i]["tpot_s"]) for i in sorted(mine))
            out.append(SameConfigCell(load, slice_, arms, configs.pop(), logs))
    return out


def explored(flag: bool | None, reason: str | None) -> bool:
    """Whether a request's decision explored: the gateway's ``specgate.explored`` (results before it was
    recorded: the decision reason says ``auto: exploring``)."""
    return "auto: exploring " in (reason or "") if flag is None else flag


def explorations(result: dict) -> dict[tuple[str, str], tuple[int, Counter[str]]]:
    """(adaptive arm, load) -> (requests, what their explorations measured), named by the decision reason
    (``... auto: exploring cold pool 'ngram' k=8 (0 rounds of evidence)`` counts as ``cold pool 'ngram' k=8``)
    or, where it does not say, by the pool and k served."""
    out: dict[tuple[str, str], tuple[int, Counter[str]]] = {}
    for r in result.get("requests", []):
        if not r["arm"].startswith("adaptive"):
            continue
        n, kinds = out.get((r["arm"], r["load"]), (0, Counter()))
        if explored(r.get("explored"), r.get("reason")):
            _, sep, what = (r.get("reason") or "").partition("auto: exploring ")
            kinds[what.split(" (")[0] if sep else f"pool '{r['pool']}' k={r['draft_tokens']}"] += 1
        out[(r["arm"], r["load"])] = (n + 1, kinds)
    return out


def between_cells_variance(cells: list[SameConfigCell]) -> tuple[float, int] | None:
    """Variance of a cell's mean log TPOT ratio between two runs of one configuration, beyond what its
    prompts' scatter explains, over the same-configuration cells at concurrent loads: (variance, cells),
    None under two such cells. Method of moments on a ratio whose true value is 1: E[d^2] = var_between +
    s^2/n, so var_between = mean(d^2 - s^2/n), floored at 0. A systematic effect of an arm's position in
    the cell also lands here (d's mean is not subtracted), which errs on the wide side."""
    terms = []
    for c in cells:
        n = len(c.logs)
        if sequential(c.load) or n < 2:
            continue
        d = statistics.fmean(c.logs)
        terms.append(d * d - statistics.variance(c.logs) / n)
    if len(terms) < 2:
        return None
    return max(0.0, statistics.fmean(terms)), len(terms)


OWN_CELLS = 10  # a load point with this many A/A cells has its own between-run variance (~10 df)


def noise_by_load(result: dict, cells: list[SameConfigCell]) -> dict[str, tuple[float, int, bool]]:
    """Concurrent load point -> (between-run variance, cells, its own): the load's own estimate where it has
    ``OWN_CELLS`` same-configuration cells (with ``--repeats`` every load has one per arm and slice; the noise
    differs by load: open-loop arrivals scatter more than a closed loop), else the estimate pooled over all
    concurrent loads, else ``(nan, 0, False)`` (intervals there unsized)."""
    pooled = between_cells_variance(cells)
    out = {}
    for load in result["settings"]["loads"]:
        if sequential(load):
            continue
        mine = [c for c in cells if c.load == load]
        own = between_cells_variance(mine) if len(mine) >= OWN_CELLS else None
        out[load] = (*own, True) if own else (*pooled, False) if pooled else (math.nan, 0, False)
    return out


def duration_estimate(result: dict, per_slice: int, max_tokens: int, loads: int) -> dict:
    """Seconds a run of ``per_slice`` requests per slice, ``max_tokens`` tokens and ``loads`` load points
    would take on this machine, scaled from this run: per load point, each cell's wall time split into its
    time to first token and its decode by the requests' own TTFT and end-to-end times; the first part
    scales with requests, the decode with requests x tokens after the first. The warm-up scales with
    tokens only (its size does not depend on per_slice)."""
    settings = result["settings"]
    by_cell: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for r in result.get("requests", []):
        if r["ok"] and r["e2e_s"]:
            by_cell[(r["arm"], r["load"], r["slice"])].append(r)

    def scaled(wall: float, reqs: list[dict], n_factor: float) -> float:
        e2e = sum(r["e2e_s"] for r in reqs)
        if not e2e:
            return wall * n_factor
        ttft = sum(r["ttft_s"] or 0.0 for r in reqs) / e2e
        tokens = statistics.fmean(r["completion_tokens"] for r in reqs)
        decode = (max_tokens - 1) / (tokens - 1) if tokens > 1 else 1.0
        return wall * n_factor * (ttft + (1 - ttft) * decode)

    n_factor = per_slice / (settings["per_slice"] * repeats(result))
    per_load: dict[str, float] = defaultdict(float)
    for arm, data in result["arms"].items():
        for load, cells in data["cells"].items():
            for slice_, c in cells.items():
                per_load[load] += scaled(c["wall_s"], by_cell[(arm, load, slice_)], n_factor)
    warmup = result.get("warmup") or []
    warm_wall = sum(r["e2e_s"] or 0.0 for r in warmup if r["ok"])  # the warm-up runs one request at a time
    warm_s = scaled(warm_wall, [r for r in warmup if r["ok"] and r["e2e_s"]], 1.0) if warmup else 0.0
    mean_load = statistics.fmean(per_load.values()) if per_load else 0.0
    return {"per_load_s": {k: round(v) for k, v in per_load.items()}, "mean_load_s": round(mean_load),
            "warmup_s": round(warm_s), "total_s": round(mean_load * loads + warm_s)}


def resolution(noise: dict[str, tuple[float, int, bool]], reps: int) -> dict[str, float]:
    """Concurrent load -> the narrowest half-width (as a ratio - 1) a paired interval there can have, however
    many prompts: the between-run term alone, 1.96 x sqrt(variance / replicates). A target closer to 1 than
    this cannot be certified at that load without more replicates."""
    return {load: math.exp(1.96 * math.sqrt(var / reps)) - 1 for load, (var, _, _) in noise.items()
            if not math.isnan(var)}


def section(result: dict, cells: list[SameConfigCell] | None = None,
            noise: dict[str, tuple[float, int, bool]] | None = None) -> list[str]:
    """The markdown section: same-configuration comparisons, and the full preset's duration. ``cells``:
    :func:`same_config_cells` of ``result``, ``noise`` its :func:`noise_by_load`, if the caller has them."""
    lines = ["\n**Same-configuration comparisons** (two arms that served one pool:k on a prompt with the same "
             "text; their TPOT ratio is noise)\n",
             "| load | prompts | median ratio | p10-p90 | cells (all prompts one config) | cell ratios |",
             "|---|---|---|---|---|---|"]
    reqs = same_config_requests(result)
    cells = same_config_cells(result) if cells is None else cells
    for load in result["settings"]["loads"]:
        ratios = sorted(math.exp(x) for ld, _, _, x in reqs if ld == load)
        mine = sorted(c.ratio for c in cells if c.load == load)
        if not ratios:
            lines.append(f"| {load} | 0 | - | - | 0 | - |")
            continue
        q = statistics.quantiles(ratios, n=10, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 9
        spread = f"{min(mine):.2f}-{max(mine):.2f}" if mine else "-"
        lines.append(f"| {load} | {len(ratios)} | {statistics.median(ratios):.3f} | {q[0]:.2f}-{q[-1]:.2f} "
                     f"| {len(mine)} | {spread} |")
    between = between_cells_variance(cells)
    floors = resolution(noise_by_load(result, cells) if noise is None else noise, repeats(result))
    replicas = sum(1 for c in cells if c.arms[0] == c.arms[1] and not sequential(c.load))
    per_load = {load: v for load in result["settings"]["loads"]
                if (v := between_cells_variance([c for c in cells if c.load == load]))}
    lines.append("\nUnder concurrent load a cell's requests share one stretch of the machine's speed: "
                 + (f"between-run standard deviation of a cell's log TPOT ratio {math.sqrt(between[0]):.3f} "
                    f"(from {between[1]} same-configuration cells"
                    + (f", {replicas} of them an arm against its own replicate" if replicas else "")
                    + ("; per load point: " + ", ".join(f"{load} {math.sqrt(v):.3f} ({n})"
                                                        for load, (v, n) in per_load.items())
                       + f", its own used where it has {OWN_CELLS} or more cells" if per_load else "")
                    + "), added to the paired intervals at those loads"
                    + (f" (divided by the {repeats(result)} replicates each side averages)." if repeats(result) > 1
                       else ".")
                    if between else "fewer than two same-configuration cells at concurrent loads, so the paired "
                    "intervals there cannot be sized and their verdicts stay open."))
    if floors:
        lines.append("That term alone keeps a paired interval at least this wide, however many prompts: "
                     + ", ".join(f"{load} ±{100 * f:.1f}%" for load, f in floors.items())
                     + f" (1.96 x its standard deviation / sqrt({repeats(result)})); a target closer to 1 than "
                     "that is open there whatever the adaptive arm does.")
    explored = explorations(result)
    if explored:
        lines += ["\n**Explorations** (measured requests of the adaptive arms whose decision explored instead of "
                  "serving the best known option)\n", "| arm | load | explored / requests | what was measured |",
                  "|---|---|---|---|"]
        for (arm, load), (n, kinds) in explored.items():
            what = ", ".join(f"{k} {v}" for k, v in kinds.most_common()) or "-"
            lines.append(f"| {arm} | {load} | {sum(kinds.values())} / {n} | {what} |")
    full = PRESETS["full"]
    est = duration_estimate(result, full["per_slice"], full["max_tokens"], len(full["loads"]))
    lines.append(f"\nEstimated duration of `--preset full` ({full['per_slice']} requests per slice, max_tokens "
                 f"{full['max_tokens']}, {len(full['loads'])} load points, these arms) on this machine, scaled from "
                 f"this run's cell wall times: {est['mean_load_s'] / 3600:.1f} h per load point, warm-up "
                 f"{est['warmup_s'] / 60:.0f} min, {est['total_s'] / 3600:.1f} h in all.")
    return lines
