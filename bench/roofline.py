"""Roofline of the embedded engine's forward on this machine: bytes and FLOPs per step, against bandwidth and GEMM rate.

Each step's bytes and FLOPs are set beside the measured weight-streaming bandwidth and GEMM throughput: why a
batching target is or is not reachable.

    .venv/bin/python -m bench.roofline --repeats 5 [--before REV]

For each shape (sequences x tokens each, after a 200-token cached prefix): the whole forward
(``ModelRunner.forward_batch``) and its linear layers alone (the same weights in the form the runner multiplies,
every layer, and the LM head on one row per sequence), median of ``--repeats``; beside it the same linear layers
as MKL's ``x @ W`` on the runner's ``[in, out]`` matrices (the runner's earlier form, without oneDNN's
prepacked weights) and on a copy in the ``[out, in]`` layout that ``F.linear`` (and an older runner)
multiplies, the three interleaved call by call; with ``--before REV``, that commit's runner's whole forward beside this one's (its
own copy of the model, calls interleaved), e.g. ``--before da8dff0`` for the runner before the layout change.
Weights are 4 bytes a parameter (fp32); a linear layer's FLOPs are 2 x rows x parameters. GB/s = weight bytes /
linear seconds (what a memory-bound step reaches); GFLOP/s = linear FLOPs / linear seconds (what a compute-bound
one reaches).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from backends.engine.model_store import load_prepared
from backends.engine.runner import Feed, ModelRunner, _mm, load_model
from bench.engine_vs import import_before

SHAPES = ((1, 1), (1, 3), (1, 5), (4, 1), (8, 1), (16, 1), (8, 5), (16, 5), (1, 64), (1, 256))


def _medians_s(fns, repeats: int) -> list[float]:
    """Median seconds of each of ``fns``, their calls interleaved (a, b, b, a, ...) so drift and neighbours'
    load fall on all of them alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for repeat in range(repeats):
        for i in (range(len(fns)) if repeat % 2 == 0 else reversed(range(len(fns)))):
            start = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _rss_mb() -> dict[str, float]:
    """This process's resident memory from /proc/self/status (Linux): VmRSS and its file-backed part, in MB."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssFile"):
                values[key] = int(rest.split()[0]) / 1024
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--before", default=None,
                        help="an earlier commit: its runner's forward too, on its own copy of the model, interleaved")
    args = parser.parse_args(argv)
    path = str(load_prepared().path)
    runner = ModelRunner(load_model(path, "float32"))
    gc.collect()
    loaded = _rss_mb()  # before --before's copy of the model
    before = None
    if args.before:
        old = importlib.import_module(import_before(args.before, Path(tempfile.mkdtemp()))[0].__package__ + ".runner")
        before = (old.ModelRunner(old.load_model(path, "float32")), old.Feed)
    layers = runner._layers
    mats = [w for layer in layers for w in layer.weights]
    forms = [w for layer in layers for w in (layer.packed or layer.weights)]  # what the runner multiplies
    head_form = runner._packed_head if runner._packed_head is not None else runner.lm_head
    layer_params = sum(w.numel() for w in mats)
    head_params = runner.lm_head.numel()
    print(f"command: python -m bench.roofline {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; decoder linear params "
          f"{layer_params / 1e6:.1f} M, LM head {head_params / 1e6:.1f} M, fp32 weights "
          f"{4 * (layer_params + head_params) / 1e6:.0f} MB; the runner's GEMM: {runner.gemm}")
    print(f"process after loading the runner: VmRSS {loaded['VmRSS']:.0f} MB, of it file-backed {loaded['RssFile']:.0f} MB")
    flipped = [w.T.contiguous() for w in mats]  # the [out, in] layout F.linear uses (this benchmark's copy)
    head_flipped = runner.lm_head.T.contiguous()
    extra = f" forward ms, {args.before} | this / {args.before} |" if before else ""
    print("| seqs x tokens | rows | forward ms | linear ms | other ms | GB/s (weights) | GFLOP/s (linear) "
          "| linear ms, x @ W | linear ms, [out, in] |" + extra)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if before else ""))
    prefix = list(range(100, 100 + args.context))
    for seqs, tokens in SHAPES:
        caches = [runner.new_cache() for _ in range(seqs)]
        runner.forward_batch([Feed(cache, prefix, 1) for cache in caches])

        def forward(runner=runner, feed=Feed, caches=caches) -> None:
            runner.forward_batch([feed(cache, [5] * tokens, 1) for cache in caches])
            for cache in caches:
                runner.rollback(cache, args.context)

        forwards = [forward]
        if before:
            old_runner, old_feed = before
            old_caches = [old_runner.new_cache() for _ in range(seqs)]
            old_runner.forward_batch([old_feed(cache, prefix, 1) for cache in old_caches])
            forwards.append(functools.partial(forward, old_runner, old_feed, old_caches))

        rows = seqs * tokens
        x = torch.randn(rows, runner.embed.shape[1])
        wide = {w.shape[0]: torch.randn(rows, w.shape[0]) for w in mats}  # the runner's [in, out] layout
        head_in = torch.randn(seqs, runner.embed.shape[1])

        @torch.inference_mode()
        def linear() -> None:
            for w, form in zip(mats, forms):
                _mm(wide[w.shape[0]] if w.shape[0] != x.shape[1] else x, form)
            _mm(head_in, head_form)

        @torch.inference_mode()
        def linear_mkl() -> None:
            for w in mats:
                (wide[w.shape[0]] if w.shape[0] != x.shape[1] else x) @ w
            head_in @ runner.lm_head

        @torch.inference_mode()
        def linear_flipped() -> None:
            for w in flipped:
                (wide[w.shape[1]] if w.shape[1] != x.shape[1] else x) @ w.T
            head_in @ head_flipped.T

        total, *old_total = _medians_s(forwards, args.repeats)
        lin, lin_mkl, lin_flipped = _medians_s([linear, linear_mkl, linear_flipped], args.repeats)
        flops = 2 * (rows * layer_params + seqs * head_params)
        print(f"| {seqs} x {tokens} | {rows} | {1000 * total:.1f} | {1000 * lin:.1f} | {1000 * (total - lin):.1f} "
              f"| {4 * (layer_params + head_params) / lin / 1e9:.1f} | {flops / lin / 1e9:.0f} "
              f"| {1000 * lin_mkl:.1f} | {1000 * lin_flipped:.1f} |"
              + (f" {1000 * old_total[0]:.1f} | {total / old_total[0]:.2f} |" if old_total else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
