"""The engine under load: output tokens/s at several concurrencies, side by side in one run.

    .venv/bin/python -m bench.engine --concurrency 1 4 8 16 --per-slice 4 --max-new-tokens 64 \
        --load-arms engine-plain engine-ngram-k4 --dtypes float32

One engine (continuous batching: one forward per step for every running sequence), closed loop: c requests
in flight, the next prompt submitted as one finishes, ``--load-requests`` requests per cell (the sampled
prompts in order, cycled). Cells run concurrency by concurrency, arms interleaved inside each, so drift hits
all alike. Per cell: output tokens/s (all generated tokens / wall time of the cell), median TPOT, mean
sequences per forward, peak KV bytes held by the target caches, and the process's peak RSS so far (ascending
concurrency, so a cell's RSS includes every earlier cell's peak). Greedy outputs are compared across every
cell: exactness under batching means a prompt's output never depends on what it was batched with
(``identical`` counts prompts whose output equals their c1 engine-plain output).

``--max-prompt-tokens N --ignore-eos`` makes the load decode-heavy (prefill, compute-bound on a CPU, is what
batching cannot amortise). ``--context-tokens N`` repeats each prompt's own ids to N tokens (memory at long contexts); the KV bound is
``--max-total-tokens`` x the bytes of one cached position (printed).
"""

from __future__ import annotations

import resource
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from backends.engine.config import EngineConfig
from backends.engine.engine import Engine
from backends.engine.model_store import load_prepared
from backends.engine.runner import load_model
from backends.engine.types import GenerateRequest, RequestOutput, SamplingParams


@dataclass
class Cell:
    arm: str
    concurrency: int
    requests: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    tpot_ms: list[float] = field(default_factory=list)
    forwards: int = 0
    sequences_fed: int = 0
    peak_kv_bytes: int = 0
    rss_mb: float = 0.0
    outputs: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def summary(self, reference: dict[int, tuple[int, ...]] | None) -> dict:
        same = sum(1 for i, out in self.outputs.items() if reference is None or reference.get(i) == out)
        return dict(arm=self.arm, c=self.concurrency, requests=self.requests, tokens=self.tokens,
                    wall_s=round(self.wall_s, 2), tok_s=round(self.tokens / self.wall_s, 2),
                    tpot_ms=round(statistics.median(self.tpot_ms), 1) if self.tpot_ms else None,
                    seqs_per_forward=round(self.sequences_fed / max(1, self.forwards), 2),
                    peak_kv_mb=round(self.peak_kv_bytes / 2**20, 1), rss_mb=round(self.rss_mb, 1),
                    identical=f"{same}/{len(self.outputs)}")


def run_cell(engine: Engine, prompts: list[list[int]], spec, arm: str, c: int, n: int, max_new: int,
             ignore_eos: bool = False) -> Cell:
    """``n`` requests, ``c`` in flight, stepped on this thread until all finish."""
    cell = Cell(arm, c)
    queue = deque((i, prompts[i % len(prompts)]) for i in range(n))
    finished: list[tuple[int, RequestOutput]] = []

    def submit() -> None:
        i, ids = queue.popleft()
        engine.submit(GenerateRequest(rid=f"{arm}-c{c}-{i}", input_ids=tuple(ids), speculation=spec,
                                      sampling=SamplingParams(max_new_tokens=max_new, temperature=0.0,
                                                              ignore_eos=ignore_eos)),
                      lambda out, i=i: finished.append((i, out)) if out.finished else None)

    forward_batch = engine.runner.forward_batch

    def counted(feeds):
        cell.forwards += 1
        cell.sequences_fed += len(feeds)
        return forward_batch(feeds)

    engine.runner.forward_batch = counted
    start = time.perf_counter()
    try:
        for _ in range(min(c, n)):
            submit()
        while len(finished) < n:
            engine.step()
            kv = sum(slot.cache.nbytes() for slot in engine._slots.values())
            cell.peak_kv_bytes = max(cell.peak_kv_bytes, kv)
            while queue and (n - len(queue)) - len(finished) < c:  # keep c in flight
                submit()
    finally:
        del engine.runner.forward_batch
    cell.wall_s = time.perf_counter() - start
    for i, out in finished:
        stats = out.stats
        cell.requests += 1
        cell.tokens += len(out.output_ids)
        cell.outputs[i % len(prompts)] = tuple(out.output_ids)
        if stats.e2e_s is not None and stats.first_token_s is not None and len(out.output_ids) > 1:
            cell.tpot_ms.append(1000 * (stats.e2e_s - stats.first_token_s) / (len(out.output_ids) - 1))
    cell.rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return cell


def add_load_arguments(parser, engine_arms: list[str]) -> None:
    load = parser.add_argument_group("load", "closed-loop concurrency on one batching engine (bench/engine_load.py)")
    load.add_argument("--concurrency", type=int, nargs="+", default=None,
                      help="run the load cells instead of the arms (e.g. 1 4 8 16)")
    load.add_argument("--load-arms", nargs="+", default=["engine-plain", "engine-ngram-k4"], choices=engine_arms,
                      metavar="ARM", help="engine arms per concurrency (default engine-plain engine-ngram-k4)")
    load.add_argument("--load-requests", type=int, default=0, help="requests per cell (default: one per prompt)")
    load.add_argument("--context-tokens", type=int, default=0, help="repeat each prompt's ids to this many tokens")
    load.add_argument("--max-prompt-tokens", type=int, default=0,
                      help="keep each prompt's last N tokens (a decode-heavy load: with --ignore-eos)")
    load.add_argument("--ignore-eos", action="store_true", help="every request generates --max-new-tokens")
    load.add_argument("--max-total-tokens", type=int, default=65536, help="the engine's KV capacity in positions")
    load.add_argument("--max-batch-tokens", type=int, default=512, help="tokens one engine step feeds")


def run_load(args, header: dict, arms: dict, render, items) -> dict:
    prepared = load_prepared()
    results: dict = {**header, "by_dtype": {}}
    for dtype in args.dtypes:
        model = load_model(str(prepared.path), dtype)
        engine = Engine(EngineConfig(model_path=str(prepared.path), dtype=dtype, draft_layers=args.draft_layers,
                                     max_running_requests=max(args.concurrency),
                                     max_total_tokens=args.max_total_tokens,
                                     max_batch_tokens=args.max_batch_tokens), model=model)
        prompts = [render(engine.tokenizer, item) for item in items]
        if args.max_prompt_tokens:
            prompts = [ids[-args.max_prompt_tokens:] for ids in prompts]
        if args.context_tokens:
            prompts = [(ids * (args.context_tokens // len(ids) + 1))[:args.context_tokens] for ids in prompts]
        n = args.load_requests or len(prompts)
        run_cell(engine, prompts[:1], arms["engine-plain"], "warm-up", 1, 1, 4)
        cells: list[Cell] = []
        for c in sorted(args.concurrency):
            for arm in args.load_arms:
                cells.append(run_cell(engine, prompts, arms[arm], arm, c, n, args.max_new_tokens, args.ignore_eos))
                print(f"{dtype} {arm} c{c}: {cells[-1].tokens / cells[-1].wall_s:.1f} tok/s", flush=True)
        reference = next((cell.outputs for cell in cells if cell.arm == "engine-plain"), None)
        position_bytes = 2 * engine.runner.layers * engine.runner.kv_heads * engine.runner.head_dim * (
            4 if dtype == "float32" else 2)
        results["by_dtype"][dtype] = dict(
            cells=[cell.summary(reference) for cell in cells], kv_bytes_per_position=position_bytes,
            kv_bound_mb=round(args.max_total_tokens * position_bytes / 2**20, 1),
            prompt_tokens=[len(p) for p in prompts])
        engine.shutdown()
    return results


def load_markdown(results: dict) -> str:
    lines = []
    for dtype, block in results["by_dtype"].items():
        cells = block["cells"]
        lines += [f"### {dtype}: {len(block['prompt_tokens'])} prompts, {min(block['prompt_tokens'])}-"
                  f"{max(block['prompt_tokens'])} tokens; KV bound {block['kv_bound_mb']} MiB "
                  f"({block['kv_bytes_per_position']} bytes per position)", "",
                  "| arm | c | requests | tokens | wall s | tok/s | x c1 | TPOT p50 ms | seqs/forward | peak KV MiB "
                  "| peak RSS MiB | identical to c1 plain |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        base = {cell["arm"]: cell["tok_s"] for cell in cells if cell["c"] == min(x["c"] for x in cells)}
        for cell in cells:
            ratio = cell["tok_s"] / base[cell["arm"]] if base.get(cell["arm"]) else float("nan")
            lines.append(f"| {cell['arm']} | {cell['c']} | {cell['requests']} | {cell['tokens']} | {cell['wall_s']} "
                         f"| {cell['tok_s']} | {ratio:.2f} | {cell['tpot_ms']} | {cell['seqs_per_forward']} "
                         f"| {cell['peak_kv_mb']} | {cell['rss_mb']} | {cell['identical']} |")
        lines.append("")
    return "\n".join(lines)
