"""Run the serving benchmark: every arm on a fresh gateway (one shared worker, or one each), every load
point, every slice, the same seeded requests; write the JSON result, the markdown report and the plots."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import platform
import random
import subprocess
import time
import zlib
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path

import httpx

from backends.engine.model_store import load_prepared
from bench.processes import cpu_model
from bench.serve.arms import (
    DEFAULT_POLICY, REPO, Arm, check_repeats, parse_arms, route_key, served_policy, tree_notes,
)
from bench.serve.client import Result, request_body, send, slo_met
from bench.serve.load import LoadPoint, drive
from bench.serve.report import markdown, plots
from bench.serve.stack import RssSampler, gateway, worker
from bench.serve.summary import cell, learning_cost
from bench.workloads import WorkItem, sample
from policies.load import load_policy_file
from telemetry.progress import Progress

class Bench:
    """One run's settings, requests and collected results."""

    def __init__(self, args: argparse.Namespace, items: list[WorkItem], warmup: list[WorkItem],
                 revision: str, slo: dict) -> None:
        self.args, self.items, self.warmup_items = args, items, warmup
        self.revision, self.slo = revision, slo
        self.loads = [LoadPoint.parse(x) for x in args.loads]
        self.slices = [s for s in (*args.slices, MIXED) if any(i.slice == s for i in items)]
        self.results: list[Result] = []
        self.warmup: list[Result] = []
        self.plain: dict[str, dict[str, str]] = {}  # load -> item -> text

    async def _batch(self, gateway_url: str, arm: str, load: LoadPoint, items: list[WorkItem], model: str,
                     out: list[Result], advance, rep: int = 0, key: str | None = None) -> float:
        """Serve ``items`` at ``load``; ``key``: the API key of the arm's route for them (arms.route_key)."""
        url = f"{gateway_url}/v1/chat/completions"
        headers = {"Authorization": f"Bearer {key}"} if key else None
        # idle connections expire before the gateway's uvicorn closes them (5 s), or a request sent on
        # one just as it closes fails (docs/reliability.md, "Found later")
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256, keepalive_expiry=4.0)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.args.request_timeout), limits=limits) as client:
            async def one(item: WorkItem, start: float) -> None:
                r = Result(arm=arm, load=load.label, slice=item.slice, item=item.id, start_s=round(start, 3), rep=rep,
                           workload_slice=item.meta.get(MIX_SLICE))
                await send(client, url, request_body(item, model, self.args.max_tokens), r, headers)
                r.slo_met = slo_met(r, self.slo["ttft_ms"], self.slo["tpot_ms"])
                out.append(r)
                advance()

            return await drive(load, items, one, self.args.seed)

    def cells(self) -> list[str]:
        """Every cell of the run in serving order: (load point, slice, replicate), as ``run_arms`` serves them."""
        return [cell_name(load, slice_, rep) for load in self.loads for slice_ in self.slices
                for rep in range(self.args.repeats)]

    def worker_flags(self) -> list[str]:
        flags = ["--max-running-requests", str(self.args.max_running_requests)]
        return flags + (["--num-threads", str(self.args.num_threads)] if self.args.num_threads else [])

    def run_arms(self, arms: list[Arm], log_dir: Path, shared: tuple[str, RssSampler] | None, advance,
                 label=lambda text: None) -> dict:
        """Every arm on its own fresh gateway (learner), in front of the ``shared`` worker (the default,
        ``--restart gateway``) or its own fresh worker, all up at once. Arms are interleaved: for every load
        point and slice, each arm serves that cell in turn (:func:`turns`: rotating order), at c1 each
        request in turn, so a drift of machine speed during the run hits every arm alike instead of whichever
        arm ran at the time. With ``--repeats R`` every arm serves every cell R times (the turns again, the
        order rotated on), so each cell has R replicates per arm: the A/A comparisons that size the noise
        between two runs of one configuration (:mod:`bench.serve.analyse`)."""
        with contextlib.ExitStack() as stack:
            stacks: dict[str, tuple[str, RssSampler, str]] = {}
            for arm in arms:
                worker_url, rss = shared or stack.enter_context(worker(log_dir, self.worker_flags(), arm.name))
                policy = served_policy(arm, worker_url, self.revision, log_dir,
                                       self.cells() if arm.cell_scopes else [])
                url = stack.enter_context(gateway(policy, log_dir, arm.name))
                model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
                stacks[arm.name] = (url, rss, model)
            for arm in arms:
                if arm.warm:
                    url, rss, model = stacks[arm.name]
                    label(f"{arm.name} warm-up")
                    point = LoadPoint("warmup", concurrency=self.args.warmup_concurrency)
                    asyncio.run(self._batch(url, arm.name, point, self.warmup_items, model, self.warmup, advance,
                                            key=route_key(arm.name)))
            cells: dict[str, dict[str, dict]] = {arm.name: {} for arm in arms}
            turn = 0
            for load in self.loads:
                for slice_ in self.slices:
                    items = [i for i in self.items if i.slice == slice_]
                    batches: dict[str, list[Result]] = {arm.name: [] for arm in arms}
                    walls = dict.fromkeys(batches, 0.0)
                    peaks = dict.fromkeys(batches, 0.0)
                    for rep in range(self.args.repeats):
                        order = turns(load, items, arms, turn)
                        turn += len(order) // len(arms)
                        for arm, group in order:
                            url, rss, model = stacks[arm.name]
                            label(f"{load.label} {slice_} {arm.name}" + (f" rep {rep + 1}" if rep else ""))
                            rss.take_peak()
                            done, offset = len(batches[arm.name]), walls[arm.name]
                            key = route_key(arm.name, self.cells().index(cell_name(load, slice_, rep))
                                            if arm.cell_scopes else None)
                            walls[arm.name] += asyncio.run(self._batch(url, arm.name, load, group, model,
                                                                       batches[arm.name], advance, rep, key))
                            for r in batches[arm.name][done:]:  # start_s counts the arm's own serving time
                                r.start_s = round(r.start_s + offset, 3)
                            peaks[arm.name] = max(peaks[arm.name], rss.take_peak())
                    if "plain" in batches:  # the first replicate's answer is the reference (later ones are checked)
                        answers = sorted((r for r in batches["plain"] if r.ok), key=lambda r: -r.rep)
                        self.plain.setdefault(load.label, {}).update({r.item: r.text for r in answers})
                    for arm in arms:
                        batch = sorted(batches[arm.name], key=lambda r: r.start_s)
                        self.results += batch
                        cells[arm.name].setdefault(load.label, {})[slice_] = cell(
                            batch, walls[arm.name], peaks[arm.name], self.plain.get(load.label))
        return {arm.name: {"policy": str(arm.policy.relative_to(REPO)), "warm": arm.warm, "cells": cells[arm.name],
                           "peak_rss_mb": max(c["peak_rss_mb"] for per in cells[arm.name].values()
                                              for c in per.values())}
                for arm in arms}


def turns(load: LoadPoint, items: list[WorkItem], arms: list[Arm], start: int = 0
          ) -> list[tuple[Arm, list[WorkItem]]]:
    """Who serves what, in order, for one cell (load point x slice). One request at a time (c1): arms take
    turns per request, so a slow spell of the machine (measured: 4 requests in a row 12% slower) lands on
    neighbouring arms' same prompt, not on one arm's whole cell. Concurrent loads: each arm serves the
    whole cell in turn (an arm's own requests are its load). The order rotates by one arm per turn
    (``start`` = the turn this cell begins with), so no arm is always served first or last; plain need not
    lead, its answers are compared once the cell is done."""
    groups = [[i] for i in items] if load.concurrency == 1 else [items]
    return [(arms[(start + j + n) % len(arms)], group) for j, group in enumerate(groups) for n in range(len(arms))]


def cell_name(load: LoadPoint, slice_: str, rep: int) -> str:
    return f"{load.label} {slice_} rep {rep}"


MIXED = "mixed"  # the one slice label of an interleaved run's cells
MIX_SLICE = "workload_slice"  # where an interleaved item keeps its own slice (WorkItem.meta)


def relabelled(items: list[WorkItem]) -> list[WorkItem]:
    """The items labelled slice ``mixed``, each keeping its own slice in ``meta``, in the same order."""
    return [replace(i, slice=MIXED, meta={**i.meta, MIX_SLICE: i.slice}) for i in items]


def mixed(items: list[WorkItem], seed: int) -> list[WorkItem]:
    """``--mix interleaved``: every slice's requests in one seeded order, labelled (:func:`relabelled`): one cell
    per load point."""
    out = relabelled(items)
    random.Random(f"mix:{seed}").shuffle(out)
    return out


def _meta(args: argparse.Namespace, argv: list[str], slo: dict) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    return {"command": "specgate bench serve " + " ".join(argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": cpu_model(), "cores": _cores(), "python": platform.python_version(),
            "torch": version("torch"), "transformers": version("transformers"), "commit": commit or "unknown",
            "slo": slo}


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _warmup_items(args: argparse.Namespace, eval_ids: set[str]) -> list[WorkItem]:
    """A seeded sample disjoint from the measured requests, slices interleaved as live traffic would be."""
    pool = sample(args.workloads, args.warmup_per_slice + args.per_slice, args.seed + 1, args.max_prompt_chars,
                  tuple(args.slices))
    by_slice: dict[str, list[WorkItem]] = {}
    for item in pool:
        if item.id not in eval_ids and len(by_slice.setdefault(item.slice, [])) < args.warmup_per_slice:
            by_slice[item.slice].append(item)
    items = [i for group in by_slice.values() for i in group]
    random.Random(args.seed).shuffle(items)
    return items


def _context_chars(max_tokens: int) -> int:
    """The longest prompt (chars) that fits the model's context with ``max_tokens`` to generate, at a
    conservative 3 characters per token (SmolLM2's tokenizer averages ~3.6 on these workloads)."""
    config = json.loads((Path(load_prepared().path) / "config.json").read_text())
    return (int(config["max_position_embeddings"]) - max_tokens - 64) * 3


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    limit = _context_chars(args.max_tokens)
    if args.max_prompt_chars > limit:
        raise ValueError(f"--max-prompt-chars {args.max_prompt_chars} exceeds the model's context window "
                         f"with max_tokens {args.max_tokens} (~{limit} chars); lower it")
    arms = parse_arms(args.arms)
    check_repeats(arms, args.repeats)
    loads = [LoadPoint.parse(x) for x in args.loads]  # validates before anything starts
    policy_slo = load_policy_file(DEFAULT_POLICY).slo
    slo = {"ttft_ms": policy_slo.ttft_ms, "tpot_ms": policy_slo.tpot_ms}
    items = sample(args.workloads, args.per_slice, args.seed, args.max_prompt_chars, tuple(args.slices))
    warm = _warmup_items(args, {i.id for i in items}) if any(a.warm for a in arms) else []
    if args.mix == "interleaved":  # the warm-up's order is already interleaved; its cost of learning is the mix's
        items, warm = mixed(items, args.seed), relabelled(warm)
    bench = Bench(args, items, warm, load_prepared().revision, slo)
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = args.out / "logs"
    log_dir.mkdir(exist_ok=True)
    meta = _meta(args, argv, slo)
    meta["notes"] = tree_notes(arms, [p.label for p in loads])
    t0 = time.perf_counter()
    total = len(arms) * len(loads) * len(items) * args.repeats + len(warm) * sum(a.warm for a in arms)
    with Progress("serve bench", total, transient=not args.keep_progress) as bar, contextlib.ExitStack() as stack:
        shared = (stack.enter_context(worker(log_dir, bench.worker_flags(), "shared"))
                  if args.restart == "gateway" else None)
        arms_out = bench.run_arms(arms, log_dir, shared, bar.advance, bar.describe)
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    result = {
        "meta": meta,
        "settings": {"arms": [a.name for a in arms], "loads": [p.label for p in loads], "slices": bench.slices,
                     "per_slice": args.per_slice, "repeats": args.repeats, "max_tokens": args.max_tokens,
                     "mix": args.mix,
                     "seed": args.seed,
                     "max_prompt_chars": args.max_prompt_chars, "warmup_per_slice": args.warmup_per_slice,
                     "warmup_concurrency": args.warmup_concurrency,
                     "max_running_requests": args.max_running_requests, "restart": args.restart},
        "workloads": {s: [{"id": i.id, "source": i.source, "truncated_from": i.truncated_from,
                           **({"slice": i.meta[MIX_SLICE]} if MIX_SLICE in i.meta else {}),
                           "prompt_chars": sum(len(str(m.get("content") or "")) for m in i.messages)}
                          for i in items if i.slice == s] for s in bench.slices},
        "arms": arms_out,
        "warmup": [r.as_dict() for r in bench.warmup],
        "learning_cost": None,
        "requests": [r.as_dict() for r in bench.results],
    }
    if bench.warmup and "adaptive-warm" in arms_out:
        cells = arms_out["adaptive-warm"]["cells"]
        ref = f"c{args.warmup_concurrency}" if f"c{args.warmup_concurrency}" in cells else loads[0].label
        learner = [r for r in bench.warmup if r.arm == "adaptive-warm"]  # not a warmed fixed arm's warm-up
        result["learning_cost"] = learning_cost(
            learner, {s: cells[ref][s]["tpot_ms"]["p50"] for s in bench.slices},
            {s: max(cells[ref][s]["choices"], key=cells[ref][s]["choices"].get, default=None) for s in bench.slices})
        result["learning_cost_reference_load"] = ref
    return result


def read(out: Path) -> dict:
    """The result a run wrote to ``out``: ``serve.json``, or ``serve.json.gz`` (a part of a run split by load
    point, kept in git compressed until the last part is merged). ValueError naming the directory."""
    plain, packed = out / "serve.json", out / "serve.json.gz"
    try:
        if not plain.exists() and packed.exists():
            return json.loads(gzip.decompress(packed.read_bytes()))
        return json.loads(plain.read_text())
    except (OSError, ValueError, EOFError, zlib.error) as exc:  # missing, not gzip, cut short, not JSON
        raise ValueError(f"{out}: cannot read serve.json or serve.json.gz ({exc}); give a directory a run "
                         "wrote") from exc


def write(result: dict, out: Path, rewrite_json: bool = True) -> tuple[Path, Path, list[Path]]:
    json_path, md_path = out / "serve.json", out / "serve.md"
    if rewrite_json:
        json_path.write_text(json.dumps(result, indent=1))
    pngs = plots(result, out)
    md_path.write_text(markdown(result, pngs))
    return json_path, md_path, pngs
