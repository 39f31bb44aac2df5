"""One result from runs of different load points: the full preset takes ~12.5 h on 2 cores, more than one
sitting, so it runs one load point at a time (``--preset full --loads c1``, then ``c4``, ...; each part's
``serve.json`` kept, gzipped, under ``docs/runs/``) and ``specgate bench serve --merge DIR DIR ... --out DIR``
joins them into one ``serve.json`` and report.

Only runs that measured the same thing are joined: the same arms, slices, sizes, seed (so the same
requests), code commit, SLO and model; load points may not repeat. Each part started its own gateways, so
each ``adaptive-warm`` arm was warmed up on its own and measured at its load point from that warm state
(within one run it would have kept learning from load point to load point); the merged file keeps every
part's command, date and wall time under ``meta.parts``. The warm-up trace and the cost of learning are the
part's whose load points include the warm-up's own (``c{warmup_concurrency}``), else the first part's.
"""

from __future__ import annotations

from pathlib import Path

from bench.serve.run import read

# settings every part must share; "loads" is what the parts split
SHARED_SETTINGS = ("arms", "slices", "per_slice", "repeats", "max_tokens", "seed", "max_prompt_chars",
                   "warmup_per_slice", "warmup_concurrency", "max_running_requests", "restart")
SHARED_META = ("commit", "slo", "cpu", "cores", "python", "torch", "transformers")


def load_parts(dirs: list[Path]) -> list[dict]:
    parts = []
    for d in dirs:
        try:
            parts.append(read(d))
        except ValueError as exc:
            raise ValueError(f"--merge {exc}") from exc
    return parts


def merge(parts: list[dict], names: list[str] | None = None) -> dict:
    """Join results of the same benchmark at different load points; ``names`` label the parts in errors
    (their directories). ValueError naming the part and the field when they differ."""
    names = names or [f"part {i + 1}" for i in range(len(parts))]
    if len(parts) < 2:
        raise ValueError("--merge needs at least two result directories")
    first, name0 = parts[0], names[0]
    seen: dict[str, str] = {}
    for part, name in zip(parts, names):
        for key in SHARED_SETTINGS:
            if _setting(part, key) != _setting(first, key):
                raise ValueError(f"--merge: {name} has settings.{key} = {_setting(part, key)!r}, {name0} has "
                                 f"{_setting(first, key)!r}; merge only runs of one command split by --loads")
        for key in SHARED_META:
            if part["meta"].get(key) != first["meta"].get(key):
                raise ValueError(f"--merge: {name} has meta.{key} = {part['meta'].get(key)!r}, {name0} has "
                                 f"{first['meta'].get(key)!r}; rerun the load points on one machine and commit")
        if part["workloads"] != first["workloads"]:
            raise ValueError(f"--merge: {name} measured other requests than {name0} (workloads differ)")
        for load in part["settings"]["loads"]:
            if load in seen:
                raise ValueError(f"--merge: load point {load} is in both {seen[load]} and {name}; keep one")
            seen[load] = name
    ref = f"c{first['settings']['warmup_concurrency']}"
    learned = next((p for p in parts if ref in p["settings"]["loads"]), first)
    arms = {}
    for arm, data in first["arms"].items():
        cells = {load: per for p in parts for load, per in p["arms"][arm]["cells"].items()}
        arms[arm] = dict(data, cells=cells, peak_rss_mb=max(p["arms"][arm]["peak_rss_mb"] for p in parts))
    meta = dict(first["meta"])
    meta.update(command="; ".join(p["meta"]["command"] for p in parts),
                date=f"{min(p['meta']['date'] for p in parts)} to {max(p['meta']['date'] for p in parts)}",
                wall_s=round(sum(p["meta"]["wall_s"] for p in parts), 1),
                parts=[{"dir": n, **{k: p["meta"][k] for k in ("command", "date", "wall_s")}}
                       for p, n in zip(parts, names)])
    merged = {key: value for key, value in first.items() if key != "learning_cost_reference_load"}
    merged.update(meta=meta, settings=dict(first["settings"], loads=list(seen)), arms=arms,
                  warmup=learned["warmup"], learning_cost=learned["learning_cost"],
                  requests=[r for p in parts for r in p["requests"]])
    if "learning_cost_reference_load" in learned:
        merged["learning_cost_reference_load"] = learned["learning_cost_reference_load"]
    return merged


def _setting(result: dict, key: str):
    return result["settings"].get(key, 1 if key == "repeats" else None)  # runs before --repeats served once
