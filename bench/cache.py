"""KV cache and forward choice for the model runner: the engine's own runner (``ModelRunner``: its Llama
forward, a preallocated cache per sequence, rollback moves a length) vs transformers' forward with
DynamicCache (+ crop) and with a preallocated StaticCache, measured side by side
on the same prompt, same dtype, interleaved.

    .venv/bin/python -m bench.cache --context 256 --steps 64 --width 5 --repeats 3

Each repeat decodes ``steps`` rounds of ``width`` positions (one verification round of k = width - 1
drafts) and rolls back width - 1 positions after each, as the engine does when every draft is rejected.
With StaticCache, rollback is free (the next write overwrites; cache_position says where) but every
forward attends over the full preallocated length; DynamicCache grows and is cropped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from transformers import DynamicCache, StaticCache

from backends.engine.model_store import load_prepared
from backends.engine.runner import ModelRunner, load_model


def run_dynamic(model, prompt: list[int], steps: int, width: int) -> float:
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
        start = time.perf_counter()
        for _ in range(steps):
            model(input_ids=torch.tensor([[5] * width]), cache=cache, use_cache=True,
                  logits_to_keep=width)
            cache.crop(-(width - 1))
        return time.perf_counter() - start


def run_runner(runner, prompt: list[int], steps: int, width: int) -> float:
    cache = runner.new_cache()
    runner.forward(cache, prompt, keep=1)
    start = time.perf_counter()
    for _ in range(steps):
        runner.forward(cache, [5] * width, keep=width)
        runner.rollback(cache, runner.cache_len(cache) - (width - 1))
    return time.perf_counter() - start


def run_static(model, prompt: list[int], steps: int, width: int, max_len: int) -> float:
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    with torch.inference_mode():
        n = len(prompt)
        model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1,
              cache_position=torch.arange(n))
        start = time.perf_counter()
        pos = n
        for _ in range(steps):
            model(input_ids=torch.tensor([[5] * width]), cache=cache, use_cache=True,
                  logits_to_keep=width, cache_position=torch.arange(pos, pos + width))
            pos += 1  # keep one position, the rest are overwritten next round
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the engine's runner vs DynamicCache vs StaticCache for rounds")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--width", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-cache-len", type=int, default=2048, help="StaticCache preallocation")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    model = load_model(str(load_prepared().path), args.dtype)
    prompt = list(range(200, 200 + args.context))
    runner = ModelRunner(model)
    own, dyn, sta = [], [], []
    for _ in range(args.repeats):
        own.append(run_runner(runner, prompt, args.steps, args.width))
        dyn.append(run_dynamic(model, prompt, args.steps, args.width))
        sta.append(run_static(model, prompt, args.steps, args.width, args.max_cache_len))
    print(f"command: python -m bench.cache {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, dtype {args.dtype}")
    for name, xs in (("ModelRunner", own), ("DynamicCache+crop", dyn), (f"StaticCache({args.max_cache_len})", sta)):
        ms = [1000 * x / args.steps for x in xs]
        print(f"{name:>22}: median {statistics.median(ms):.2f} ms/round (runs: {', '.join(f'{m:.2f}' for m in ms)})")
    print(f"static / dynamic: {statistics.median(sta) / statistics.median(dyn):.3f}; "
          f"runner / dynamic: {statistics.median(own) / statistics.median(dyn):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
