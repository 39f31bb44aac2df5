"""This checkout's engine against an earlier commit's and transformers' generate, side by side in one process, at c1.

A change to the engine must leave it no slower than before, and plain decoding at c1 at least 1.25x
transformers' ``generate``; this measures both.

    .venv/bin/python -m bench.engine_vs --before 7fe2959 --per-slice 3 --max-new-tokens 64 \
        --arms plain ngram-k4 ngram-k8 --repeats 2

The earlier commit's ``backends/engine`` is extracted with ``git archive`` into a temporary folder and imported
under another package name (``specgate_before.engine``), so both engines and transformers' ``generate`` run the
same weights (one model object each, loaded from the same files) on the same prompts, interleaved per prompt: for
every prompt and repeat, ``hf`` (plain greedy ``generate``) and then each arm before and after, the order of
before/after alternating by repeat.
Tokens/s per slice = generated tokens / wall time; greedy outputs are compared (before == after == hf).
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.engine import render
from bench.workloads import DEFAULT_ROOT, SLICES, sample
from backends.engine.config import EngineConfig
from backends.engine.engine import Engine
from backends.engine.model_store import load_prepared
from backends.engine.runner import load_model
from backends.engine import types as after_types

ARMS = {"plain": dict(), "ngram-k2": dict(proposer="ngram", draft_tokens=2),
        "ngram-k4": dict(proposer="ngram", draft_tokens=4), "ngram-k8": dict(proposer="ngram", draft_tokens=8),
        "draft-k4": dict(proposer="draft_model", draft_tokens=4)}
PACKAGE = "specgate_before"


def import_before(rev: str, root: Path):
    """``backends/engine`` of ``rev`` as package ``specgate_before.engine`` (its imports rewritten)."""
    repo = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "backends/engine"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    package = root / PACKAGE
    package.mkdir()
    (root / "backends" / "engine").rename(package / "engine")
    (package / "__init__.py").write_text("")
    for path in package.rglob("*.py"):
        path.write_text(path.read_text().replace("backends.engine", f"{PACKAGE}.engine"))
    sys.path.insert(0, str(root))
    return importlib.import_module(f"{PACKAGE}.engine.engine"), importlib.import_module(f"{PACKAGE}.engine.types")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the earlier commit (e.g. 7fe2959)")
    parser.add_argument("--workloads", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--per-slice", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-chars", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", nargs="+", default=["plain", "ngram-k4", "ngram-k8"], choices=list(ARMS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    items = sample(args.workloads, args.per_slice, args.seed, args.max_chars)
    prepared = load_prepared()
    with tempfile.TemporaryDirectory() as tmp:
        old_engine, old_types = import_before(args.before, Path(tmp))
        # one model object each: an engine re-lays its model's weights out (fused and
        # transposed) and re-points the modules at them, so transformers' `generate` gets a model as
        # from_pretrained loads it, and each engine its own
        model = load_model(str(prepared.path), "float32")
        config = dict(model_path=str(prepared.path), calibrate=True)
        before = old_engine.Engine(old_engine.EngineConfig(**config),
                                   model=load_model(str(prepared.path), "float32"))
        after = Engine(EngineConfig(**config), model=load_model(str(prepared.path), "float32"))
        engines = {"before": (before, old_types), "after": (after, after_types)}
        tokenizer = after.tokenizer
        seconds: dict[tuple[str, str, str], float] = defaultdict(float)
        tokens: dict[tuple[str, str, str], int] = defaultdict(int)
        differ: list[str] = []
        prompts = [render(tokenizer, item) for item in items]
        for name, (engine, types) in engines.items():  # warm-up
            engine.generate(types.GenerateRequest(rid=f"w-{name}", input_ids=tuple(prompts[0]),
                                                  sampling=types.SamplingParams(max_new_tokens=4)))
        for repeat in range(args.repeats):
            order = ["before", "after"] if repeat % 2 == 0 else ["after", "before"]
            for n, (item, ids) in enumerate(zip(items, prompts)):
                start = time.perf_counter()
                with torch.inference_mode():
                    tensor = torch.tensor([ids])
                    out = model.generate(tensor, attention_mask=torch.ones_like(tensor), do_sample=False,
                                         max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.eos_token_id)
                hf = tuple(out[0, len(ids):].tolist())
                seconds["hf", "plain", item.slice] += time.perf_counter() - start
                tokens["hf", "plain", item.slice] += len(hf)
                for arm in args.arms:
                    for which in order:
                        engine, types = engines[which]
                        start = time.perf_counter()
                        result = engine.generate(types.GenerateRequest(
                            rid=f"{which}-{arm}-{repeat}-{n}", input_ids=tuple(ids),
                            sampling=types.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0),
                            speculation=types.SpeculationParams(**ARMS[arm])))
                        seconds[which, arm, item.slice] += time.perf_counter() - start
                        tokens[which, arm, item.slice] += len(result.output_ids)
                        if tuple(result.output_ids)[:len(hf)] != hf[:len(result.output_ids)]:
                            differ.append(f"{which} {arm} {item.id}")
                print(f"repeat {repeat + 1} prompt {n + 1}/{len(items)}", file=sys.stderr, flush=True)
        before.shutdown()
        after.shutdown()
    rows = {}
    for slice_ in [*SLICES, "all"]:
        keys = [s for s in SLICES] if slice_ == "all" else [slice_]
        rate = {(w, a): sum(tokens[w, a, s] for s in keys) / max(1e-9, sum(seconds[w, a, s] for s in keys))
                for w, a, _ in tokens}
        rows[slice_] = {f"{w}/{a}": round(r, 2) for (w, a), r in rate.items()}
    print(f"command: python -m bench.engine_vs {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; output tokens/s (greedy, fp32, c1)")
    print("| slice | hf plain | " + " | ".join(f"{a} before | {a} after | after/before" for a in args.arms)
          + " | after plain / hf |")
    print("|---|---:|" + "---:|---:|---:|" * len(args.arms) + "---:|")
    for slice_, r in rows.items():
        cells = [f"{r[f'before/{a}']} | {r[f'after/{a}']} | {r[f'after/{a}'] / r[f'before/{a}']:.3f}"
                 for a in args.arms]
        plain = f"{r['after/plain'] / r['hf/plain']:.3f}" if "after/plain" in r else "-"
        print(f"| {slice_} | {r['hf/plain']} | " + " | ".join(cells) + f" | {plain} |")
    print(f"outputs differing from hf generate: {len(differ)} {differ[:10]}")
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "differ": differ}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
