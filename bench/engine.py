"""Engine benchmark: transformers generate vs specgate's engine, side by side, same prompts, same dtype.

    .venv/bin/python -m bench.engine --per-slice 3 --max-new-tokens 64 \
        --dtypes float32 bfloat16 --out results/engine.json --markdown docs/engine-bench.md

Arms (greedy, temperature 0, one request at a time; ``--arms`` picks a subset, default all):
- ``hf-plain``: ``model.generate``; ``hf-lookup-k``: prompt lookup (``prompt_lookup_num_tokens=k``);
  ``hf-assisted``: assisted generation with the same layer-truncated self-draft our engine uses;
- ``engine-plain``, ``engine-ngram-k`` (k = 2, 4, 8), ``engine-ngram-adaptive`` (k <= 8),
  ``engine-draft-k4`` (layer-truncated self-draft), ``engine-suffix-k`` (k = 4, 8; one scope per arm, so
  its global tree holds that arm's outputs of the earlier prompts of the run, never another arm's copy of
  the same output).
``--concurrency 1 4 8 16``: the load cells of bench/engine_load.py instead (one batching engine, closed loop).
Arms are interleaved per prompt (every arm runs prompt i before any runs prompt i+1) so drift on a noisy
machine hits all arms alike. Tokens/s = generated tokens / wall time of the request, summed per slice.

Accept length = generated tokens / target forwards that committed tokens (SGLang's spec_accept_length).
For the engine the forwards are ``stats.verify_ct`` (its prefill forwards are not rounds). For transformers
a forward pre-hook counts the target's calls: in assisted generation the first call is prefill plus the
first candidates and every later call one round, so calls = rounds, as in the engine; plain ``generate``
makes one call per token. The model-free arms are also replayed exactly on the engine-plain outputs
(``backends/engine/counterfactual.py``): transformers' rule (n-gram n <= 2, earliest match) checks the hook
count, and the ``latest`` n-gram rule and suffix with only the request's own tree cost no model time.
The target table counts, per k in (4, 8), the prompts where engine-ngram drafts worse, equal or better
than transformers' prompt lookup.

``--stream``: the ``--stream-slice`` prompts in file order, each after the previous one completed, on one
engine, arms engine-plain, engine-ngram-k8 and engine-suffix-k8 (one scope: suffix's global tree grows as
requests complete), reported per block of ``--stream-block`` requests with the replay's numbers beside.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path

import torch
import transformers

from bench.engine_load import add_load_arguments, load_markdown, run_load
from bench.processes import cpu_model
from bench.workloads import DEFAULT_ROOT, SLICES, WorkItem, load_all, sample
from telemetry.progress import Progress
from backends.engine.config import EngineConfig
from backends.engine.counterfactual import Recorded, replay
from backends.engine.engine import Engine
from backends.engine.model_store import load_prepared
from backends.engine.proposers.draft_model import layer_truncated_draft
from backends.engine.runner import DTYPES, load_model
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams

ENGINE_ARMS: dict[str, SpeculationParams] = {
    "engine-plain": SpeculationParams(),
    "engine-ngram-k2": SpeculationParams(proposer="ngram", draft_tokens=2),
    "engine-ngram-k4": SpeculationParams(proposer="ngram", draft_tokens=4),
    "engine-ngram-k8": SpeculationParams(proposer="ngram", draft_tokens=8),
    "engine-ngram-adaptive": SpeculationParams(proposer="ngram", draft_tokens=8, adaptive=True),
    "engine-draft-k4": SpeculationParams(proposer="draft_model", draft_tokens=4),
    "engine-suffix-k4": SpeculationParams(proposer="suffix", draft_tokens=4, scope="engine-suffix-k4"),
    "engine-suffix-k8": SpeculationParams(proposer="suffix", draft_tokens=8, scope="engine-suffix-k8"),
}
HF_LOOKUP = (2, 4, 8)
ARMS = ("hf-plain", *(f"hf-lookup-k{k}" for k in HF_LOOKUP), "hf-assisted", *ENGINE_ARMS)
TARGET_K = (4, 8)
# Replayed on the engine-plain outputs (no model time): transformers' rule, the engine's n-gram with the
# ``earliest`` and the ``latest`` match, suffix as the run served it (its arm's scope, prompts in run order)
# and with only the request's own tree (a scope per request)
REPLAYED = {
    **{f"hf-lookup-k{k} (replay)": SpeculationParams(proposer="ngram", draft_tokens=k, ngram_max=2)
       for k in TARGET_K},
    **{f"engine-ngram-k{k} (replay)": ENGINE_ARMS[f"engine-ngram-k{k}"] for k in TARGET_K},
    **{f"ngram-latest-k{k} (replay)": replace(ENGINE_ARMS[f"engine-ngram-k{k}"], ngram_match="latest")
       for k in TARGET_K},
    **{f"engine-suffix-k{k} (replay)": ENGINE_ARMS[f"engine-suffix-k{k}"] for k in TARGET_K},
    **{f"suffix-own-tree-k{k} (replay)": ENGINE_ARMS[f"engine-suffix-k{k}"] for k in TARGET_K},
}
STREAM_ARMS = ("engine-plain", "engine-ngram-k8", "engine-suffix-k8")  # --stream


@dataclass(frozen=True, slots=True)
class Run:
    """One arm on one prompt."""

    prompt: str  # WorkItem.id
    slice: str
    output: tuple[int, ...]
    forwards: int  # target forwards that committed tokens (rounds; a plain step is one)
    seconds: float

    @property
    def accept(self) -> Fraction | None:
        return Fraction(len(self.output), self.forwards) if self.forwards else None


class ForwardCounter:
    """Counts calls of the target model (a forward pre-hook on the top-level module; the self-draft is
    another module object, so its calls are not counted)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = model.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        self.calls += 1

    def remove(self) -> None:
        self._handle.remove()


class Arms:
    """The model, its engine and transformers' generate, one prompt at a time."""

    def __init__(self, dtype: str, max_new: int, draft_layers: int) -> None:
        prepared = load_prepared()
        self.model = load_model(str(prepared.path), dtype)
        self.engine = Engine(EngineConfig(model_path=str(prepared.path), dtype=dtype, draft_layers=draft_layers),
                             model=self.model)
        self.tokenizer = self.engine.tokenizer
        self.assistant = layer_truncated_draft(self.model, draft_layers)
        self.counter = ForwardCounter(self.model)
        self.max_new = max_new
        self.gen_kwargs = dict(do_sample=False, pad_token_id=self.tokenizer.eos_token_id)

    def run(self, arm: str, item: WorkItem, ids: list[int], rid: str, max_new: int | None = None) -> Run:
        max_new = max_new or self.max_new
        start = time.perf_counter()
        if arm.startswith("hf-"):
            extra = {}
            if arm.startswith("hf-lookup"):
                extra = {"prompt_lookup_num_tokens": int(arm.rsplit("k", 1)[1])}
            elif arm == "hf-assisted":
                extra = {"assistant_model": self.assistant}
            tensor = torch.tensor([ids])
            self.counter.calls = 0
            with torch.inference_mode():
                out = self.model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=max_new,
                                          **self.gen_kwargs, **extra)
            new, forwards = tuple(out[0, len(ids):].tolist()), self.counter.calls
        else:
            result = self.engine.generate(GenerateRequest(
                rid=rid, input_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=max_new, temperature=0.0),
                speculation=ENGINE_ARMS[arm]))
            new, forwards = tuple(result.output_ids), result.stats.verify_ct
        return Run(item.id, item.slice, new, forwards, time.perf_counter() - start)

    def warm_up(self, ids: list[int]) -> None:
        """First calls pay one-off costs (allocator, kernels); keep them out of the first arm's time."""
        dummy = WorkItem(id="warm-up", slice="", messages=[])
        self.run("hf-plain", dummy, ids, "warm-up-hf", max_new=4)
        self.run("engine-plain", dummy, ids, "warm-up-engine", max_new=4)

    def close(self) -> None:
        self.counter.remove()
        self.engine.shutdown()


def render(tokenizer, item: WorkItem) -> list[int]:
    messages = item.messages
    if item.tools:  # SmolLM2's template has no tool slot: list the tools in a system message
        tools = json.dumps([t["function"] for t in item.tools])
        messages = [{"role": "system", "content": f"You can call these functions:\n{tools}"}, *messages]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def run_dtype(dtype: str, items: list[WorkItem], max_new: int, draft_layers: int, arms: list[str],
              rid_prefix: str = "") -> tuple[dict[str, list[Run]], list[Recorded]]:
    """Every arm on every prompt (interleaved per prompt, in ``items``' order, on one engine per arm); also each
    prompt as a greedy record for replay. ``rid_prefix`` names the requests (a suffix scope is per arm)."""
    bench = Arms(dtype, max_new, draft_layers)
    runs: dict[str, list[Run]] = {a: [] for a in arms}
    records = []
    with Progress(f"engine bench {dtype}", len(items) * len(arms)) as bar:
        for n, item in enumerate(items):
            ids = render(bench.tokenizer, item)
            if n == 0:
                bench.warm_up(ids)
            for arm in arms:
                runs[arm].append(bench.run(arm, item, ids, f"{rid_prefix}{arm}-{n}"))
                bar.advance(description=f"{item.slice} {item.id} {arm}: accept length {_fmt(runs[arm][-1].accept)}")
            records.append(Recorded(prompt=tuple(ids), output=(), max_new_tokens=max_new))
    bench.close()
    return runs, records


def replayed(runs: dict[str, list[Run]], records: list[Recorded], names) -> dict[str, list[Run]]:
    """The ``REPLAYED`` arms ``names`` on the outputs of engine-plain (else hf-plain; else none)."""
    base = runs.get("engine-plain") or runs.get("hf-plain")
    if not base:
        return {}
    done = [replace(rec, output=run.output) for rec, run in zip(records, base)]
    out = {}
    for name in names:
        spec = REPLAYED[name]
        if name.startswith("suffix-own-tree"):  # a scope per request: its own tree, no earlier outputs
            trace = [replace(rec, scope=f"own-{i}") for i, rec in enumerate(done)]
        else:
            trace = [replace(rec, scope=spec.scope) for rec in done]
        out[name] = [Run(run.prompt, run.slice, run.output, r.rounds, 0.0)
                     for run, r in zip(base, replay(trace, spec))]
    return out


def _fmt(x: Fraction | float | None) -> str:
    return "-" if x is None else f"{float(x):.2f}"


def pooled(runs: list[Run]) -> Fraction | None:
    """Accept length over a set of prompts: tokens summed / forwards summed."""
    forwards = sum(r.forwards for r in runs)
    return Fraction(sum(len(r.output) for r in runs), forwards) if forwards else None


def summarise(runs: dict[str, list[Run]], slices: tuple[str, ...]) -> dict:
    table = {}
    for s in slices:
        arms = {a: [r for r in rs if r.slice == s] for a, rs in runs.items()}
        tok_s = {a: sum(len(r.output) for r in rs) / max(1e-9, sum(r.seconds for r in rs)) for a, rs in arms.items()}
        ref = arms.get("engine-plain")
        table[s] = {a: {
            "tok_s": round(tok_s[a], 2),
            "speedup_vs_engine_plain": round(tok_s[a] / tok_s["engine-plain"], 3) if ref else None,
            "speedup_vs_hf_plain": round(tok_s[a] / tok_s["hf-plain"], 3) if "hf-plain" in arms else None,
            "accept_length": round(float(pooled(rs)), 3) if pooled(rs) else None,
            "tokens": sum(len(r.output) for r in rs),
            "identical_to_engine_plain": sum(r.output == b.output for r, b in zip(rs, ref)) if ref else None,
            "prompts": len(rs),
        } for a, rs in arms.items()}
    return table


def compare(runs: dict[str, list[Run]], ours: str, theirs: str) -> dict | None:
    """Per prompt: is ``ours``'s accept length below, equal to or above ``theirs``'s (exact fractions)?"""
    if ours not in runs or theirs not in runs:
        return None
    out = {"worse": [], "equal": [], "better": []}
    for a, b in zip(runs[ours], runs[theirs]):
        x, y = a.accept or 0, b.accept or 0
        out["worse" if x < y else "equal" if x == y else "better"].append(a.prompt)
    return out


def analyse(runs: dict[str, list[Run]], records: list[Recorded]) -> dict:
    """Target counts, checks of the hook count and of replay, and the accept-length table per slice."""
    runs = {**runs, **replayed(runs, records, REPLAYED)}
    target = {}
    for k in TARGET_K:
        for ours in (f"engine-ngram-k{k}", f"ngram-latest-k{k} (replay)"):
            if (c := compare(runs, ours, f"hf-lookup-k{k}")) is not None:
                target[f"{ours} vs hf-lookup-k{k}"] = c
    checks = {}
    for measured in [a for a in ARMS if f"{a} (replay)" in runs and a in runs]:
        pairs = zip(runs[measured], runs[f"{measured} (replay)"])
        checks[measured] = {"same": 0, "differ": []}
        for m, r in pairs:
            if m.output == r.output and m.forwards == r.forwards:
                checks[measured]["same"] += 1
            else:
                checks[measured]["differ"].append({"prompt": m.prompt, "measured": [len(m.output), m.forwards],
                                                   "replay": [len(r.output), r.forwards]})
    columns = [c for k in TARGET_K for c in (f"hf-lookup-k{k}", f"engine-ngram-k{k}", f"ngram-latest-k{k} (replay)",
                                              f"engine-suffix-k{k}", f"suffix-own-tree-k{k} (replay)") if c in runs]
    accept = {}
    if columns:
        present = [s for s in SLICES if any(r.slice == s for r in runs[columns[0]])]
        accept = {s: {c: _round(pooled([r for r in runs[c] if r.slice == s])) for c in columns} for s in present}
        accept["all"] = {c: _round(pooled(runs[c])) for c in columns}
    per_prompt = {r.prompt: {a: [len(runs[a][i].output), runs[a][i].forwards] for a in runs}
                  for i, r in enumerate(next(iter(runs.values())))}
    base = runs.get("engine-plain") or runs.get("hf-plain") or []
    greedy = {run.prompt: {"prompt": list(rec.prompt), "output": list(run.output)} for rec, run in zip(records, base)}
    return {"target": target, "checks": checks, "accept_length": accept, "per_prompt_tokens_forwards": per_prompt,
            "greedy_records": greedy}


def _round(x: Fraction | None) -> float | None:
    return round(float(x), 3) if x is not None else None


def markdown(results: dict) -> str:
    lines = []
    for dtype, table in results["by_dtype"].items():
        lines.append(f"\n#### {dtype}\n")
        slices = list(table)
        lines.append("| arm | " + " | ".join(f"{s} tok/s (x plain, acc len)" for s in slices) + " |")
        lines.append("|---|" + "---|" * len(slices))
        for arm in next(iter(table.values())):
            cells = []
            for s in slices:
                r = table[s][arm]
                x = f"{r['speedup_vs_engine_plain']:.2f}x" if r["speedup_vs_engine_plain"] is not None else "-"
                acc = f", {r['accept_length']:.2f}" if r["accept_length"] else ""
                same = "" if r["identical_to_engine_plain"] in (None, r["prompts"]) else \
                    f", {r['identical_to_engine_plain']}/{r['prompts']} identical"
                cells.append(f"{r['tok_s']:.1f} ({x}{acc}{same})")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lines.append(analysis_markdown(results["analysis"][dtype]))
    return "\n".join(lines) + "\n"


def analysis_markdown(a: dict) -> str:
    lines = []
    if a["accept_length"]:
        columns = list(next(iter(a["accept_length"].values())))
        lines += ["", "Accept length (tokens per target forward, pooled over the slice's prompts):", "",
                  "| slice | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
        lines += [f"| {s} | " + " | ".join(_fmt(row[c]) for c in columns) + " |"
                  for s, row in a["accept_length"].items()]
    if a["target"]:
        lines += ["", "Per prompt, accept length against transformers' prompt lookup at equal k:", "",
                  "| arm | worse | equal | better | worse on |", "|---|---|---|---|---|"]
        for name, c in a["target"].items():
            lines.append(f"| {name} | {len(c['worse'])} | {len(c['equal'])} | {len(c['better'])} | "
                         f"{', '.join(c['worse']) or '-'} |")
    if a["checks"]:
        lines += ["", "Replay on the engine-plain outputs against the measured arm (same tokens and forwards):", ""]
        for arm, c in a["checks"].items():
            differ = "; ".join(f"{d['prompt']} measured {d['measured'][0]} tokens / {d['measured'][1]} forwards, "
                               f"replay {d['replay'][0]} / {d['replay'][1]}" for d in c["differ"])
            total = c["same"] + len(c["differ"])
            lines.append(f"- {arm}: {c['same']}/{total} prompts" + (f" ({differ})" if differ else ""))
    return "\n".join(lines)


# --stream: one slice's requests in file order, each after the previous one completed, on ONE engine and one
# suffix scope, so suffix decoding's global tree grows as requests accumulate; accept length and tok/s per block
# of requests, and the counterfactual replay of the same stream beside them.
STREAM_REPLAYED = ("engine-ngram-k8 (replay)", "engine-suffix-k8 (replay)", "suffix-own-tree-k8 (replay)")


def run_stream(args, header: dict) -> dict:
    items = [i for i in load_all(args.workloads, args.max_chars)[args.stream_slice]
             if i.source.startswith(args.stream_source)][:args.stream_requests]
    header["prompts"] = [i.id for i in items]
    results = {**header, "by_dtype": {}}
    for dtype in args.dtypes:
        runs, records = run_dtype(dtype, items, args.max_new_tokens, args.draft_layers, list(STREAM_ARMS), "stream-")
        runs |= replayed(runs, records, STREAM_REPLAYED)
        blocks = [(b, min(b + args.stream_block, len(items))) for b in range(0, len(items), args.stream_block)]
        table = {}
        for lo, hi in [*blocks, (0, len(items))]:
            label = f"{lo + 1}-{hi}" if (lo, hi) != (0, len(items)) else "all"
            table[label] = {a: {"tok_s": round(sum(len(r.output) for r in rs[lo:hi]) / s, 2) if (s := sum(
                r.seconds for r in rs[lo:hi])) else None, "accept_length": _round(pooled(rs[lo:hi]))}
                for a, rs in runs.items()}
        checks = {a: sum(m.forwards == r.forwards and m.output == r.output
                         for m, r in zip(runs[a], runs[f"{a} (replay)"])) for a in STREAM_ARMS[1:]}
        results["by_dtype"][dtype] = {"blocks": table, "replay_equals_engine": checks,
                                      "per_request_tokens_forwards": {
                                          r.prompt: {a: [len(runs[a][i].output), runs[a][i].forwards] for a in runs}
                                          for i, r in enumerate(runs["engine-plain"])}}
    return results


def stream_markdown(results: dict) -> str:
    lines = []
    for dtype, r in results["by_dtype"].items():
        arms = list(next(iter(r["blocks"].values())))
        lines += [f"\n#### {dtype}\n", "| requests | " + " | ".join(
            f"{a} tok/s, acc len" if "(replay)" not in a else f"{a} acc len" for a in arms) + " |",
            "|---|" + "---|" * len(arms)]
        for label, row in r["blocks"].items():
            lines.append(f"| {label} | " + " | ".join(
                f"{_fmt(row[a]['tok_s'])}, {_fmt(row[a]['accept_length'])}" if "(replay)" not in a
                else _fmt(row[a]["accept_length"]) for a in arms) + " |")
        n = len(r["per_request_tokens_forwards"])
        lines += ["", "Replay equals the engine (tokens and forwards per request): " + ", ".join(
            f"{a} {same}/{n}" for a, same in r["replay_equals_engine"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--per-slice", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-chars", type=int, default=3000, help="truncate long prompts (middle)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--draft-layers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, metavar="ARM",
                        help=f"arms to run, in this order per prompt (default all: {' '.join(ARMS)})")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None, help="write the tables to this file")
    add_load_arguments(parser, list(ENGINE_ARMS))
    stream = parser.add_argument_group("stream", "requests of one slice in file order on one engine")
    stream.add_argument("--stream", action="store_true", help=f"run the stream instead ({', '.join(STREAM_ARMS)})")
    stream.add_argument("--stream-slice", default="tool_call", choices=SLICES)
    stream.add_argument("--stream-source", default="", help="only prompts whose source starts with this "
                        "(e.g. BFCL_v4_simple_python); default all, in load order")
    stream.add_argument("--stream-requests", type=int, default=40)
    stream.add_argument("--stream-block", type=int, default=10, help="report per block of this many requests")
    args = parser.parse_args(argv)
    header = {
        "command": "python -m bench.engine " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(), "threads": torch.get_num_threads(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "max_new_tokens": args.max_new_tokens,
    }
    if args.concurrency:
        items = sample(args.workloads, args.per_slice, args.seed, args.max_chars)
        print(json.dumps(header, indent=1))
        results = run_load(args, header, ENGINE_ARMS, render, items)
        text = load_markdown(results)
    elif args.stream:
        print(json.dumps(header, indent=1))
        results = run_stream(args, header)
        text = stream_markdown(results)
    else:
        items = sample(args.workloads, args.per_slice, args.seed, args.max_chars)
        header["prompts"] = {s: [i.id for i in items if i.slice == s] for s in SLICES}
        header["arms"] = args.arms
        print(json.dumps(header, indent=1))
        results = {**header, "by_dtype": {}, "analysis": {}}
        for dtype in args.dtypes:
            runs, records = run_dtype(dtype, items, args.max_new_tokens, args.draft_layers, args.arms)
            results["by_dtype"][dtype] = summarise(runs, SLICES)
            results["analysis"][dtype] = analyse(runs, records)
        text = markdown(results)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    if args.markdown:
        args.markdown.write_text(f"Command: `{header['command']}`\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
