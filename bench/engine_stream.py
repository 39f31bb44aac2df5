"""``python -m bench.engine --stream``: one slice's requests in file order, each after the previous one
completed, on ONE engine and one suffix scope, so suffix decoding's global tree grows as requests accumulate;
accept length and tok/s per block of requests, and the counterfactual replay of the same stream beside them."""

from __future__ import annotations

import sys

from backends.engine.counterfactual import Recorded
from bench.engine import STREAM_ARMS, Arms, Run, _fmt, _round, pooled, render, replayed
from bench.workloads import load_all

STREAM_REPLAYED = ("engine-ngram-k8 (replay)", "engine-suffix-k8 (replay)", "suffix-own-tree-k8 (replay)")


def run_stream(args, header: dict) -> dict:
    items = [i for i in load_all(args.workloads, args.max_chars)[args.stream_slice]
             if i.source.startswith(args.stream_source)][:args.stream_requests]
    header["prompts"] = [i.id for i in items]
    results = {**header, "by_dtype": {}}
    for dtype in args.dtypes:
        bench = Arms(dtype, args.max_new_tokens, args.draft_layers)
        runs: dict[str, list[Run]] = {a: [] for a in STREAM_ARMS}
        records = []
        for n, item in enumerate(items):
            ids = render(bench.tokenizer, item)
            if n == 0:
                bench.warm_up(ids)
            for arm in STREAM_ARMS:
                runs[arm].append(bench.run(arm, item, ids, f"stream-{arm}-{n}"))
            records.append(Recorded(prompt=tuple(ids), output=(), max_new_tokens=args.max_new_tokens))
            print(f"{dtype} request {n + 1}/{len(items)} {item.id}: " + ", ".join(
                f"{a} {_fmt(runs[a][-1].accept)}" for a in STREAM_ARMS), file=sys.stderr)
        bench.close()
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
