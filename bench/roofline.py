"""Roofline of the embedded engine's forward on this machine: bytes and FLOPs per step against the measured
weight-streaming bandwidth and GEMM throughput (issue 27: why a batching target is or is not reachable).

    .venv/bin/python -m bench.roofline --repeats 5

For each shape (sequences x tokens each, after a 200-token cached prefix): the whole forward
(``ModelRunner.forward_batch``) and its linear layers alone (the same fused weight matrices, every layer, and
the LM head on one row per sequence), median of ``--repeats``. Weights are 4 bytes a parameter (fp32); a
linear layer's FLOPs are 2 x rows x parameters. GB/s = weight bytes / linear seconds (what a memory-bound step
reaches); GFLOP/s = linear FLOPs / linear seconds (what a compute-bound one reaches).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from backends.engine.model_store import load_prepared
from backends.engine.runner import Feed, ModelRunner, load_model

SHAPES = ((1, 1), (4, 1), (8, 1), (16, 1), (1, 5), (8, 5), (1, 64), (1, 256))


def _median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=200)
    args = parser.parse_args(argv)
    runner = ModelRunner(load_model(str(load_prepared().path), "float32"))
    layers = runner._layers
    mats = [w for layer in layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    layer_params = sum(w.numel() for w in mats)
    head_params = runner.lm_head.numel()
    print(f"command: python -m bench.roofline {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; decoder linear params "
          f"{layer_params / 1e6:.1f} M, LM head {head_params / 1e6:.1f} M, fp32 weights "
          f"{4 * (layer_params + head_params) / 1e6:.0f} MB")
    print("| seqs x tokens | rows | forward ms | linear ms | other ms | GB/s (weights) | GFLOP/s (linear) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    prefix = list(range(100, 100 + args.context))
    for seqs, tokens in SHAPES:
        caches = [runner.new_cache() for _ in range(seqs)]
        runner.forward_batch([Feed(cache, prefix, 1) for cache in caches])

        def forward() -> None:
            runner.forward_batch([Feed(cache, [5] * tokens, 1) for cache in caches])
            for cache in caches:
                runner.rollback(cache, args.context)

        rows = seqs * tokens
        x = torch.randn(rows, runner.embed.shape[1])
        wide = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in mats}
        head_in = torch.randn(seqs, runner.embed.shape[1])

        @torch.inference_mode()
        def linear() -> None:
            for w in mats:
                (wide[w.shape[1]] if w.shape[1] != x.shape[1] else x) @ w.T
            head_in @ runner.lm_head.T

        total, lin = _median_s(forward, args.repeats), _median_s(linear, args.repeats)
        flops = 2 * (rows * layer_params + seqs * head_params)
        print(f"| {seqs} x {tokens} | {rows} | {1000 * total:.1f} | {1000 * lin:.1f} | {1000 * (total - lin):.1f} "
              f"| {4 * (layer_params + head_params) / lin / 1e9:.1f} | {flops / lin / 1e9:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
