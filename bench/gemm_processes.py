"""How a forward's time varies from one process to the next, per GEMM form (docs/engine.md, "The GEMM").

    .venv/bin/python -m bench.gemm_processes --processes 8 --gemms onednn mkl

Each of ``--processes`` rounds starts one fresh Python process per form in ``--gemms`` (alternating, so drift
falls on both), which loads the model, grows one cache to ``--context`` tokens of a real text (the source of
Python's argparse module, as ``specgate trace calibrate`` uses) and times a forward of each width in
``--widths`` (the last committed token plus k drafts: what a verify round feeds), widths interleaved,
``--repeats`` times after one warm-up pass. Prints each process's medians, then per form and width the range over
processes and max / min, and the range of each width's time relative to the first width's in the same process:
the spread a cost model calibrated in one process carries into another.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def measure(gemm: str, context: int, widths: list[int], repeats: int) -> dict[int, float]:
    """In this process: median seconds of a forward of each width after ``context`` cached tokens."""
    from backends.engine.calibrate import default_text
    from backends.engine.model_store import load_prepared
    from backends.engine.runner import ModelRunner, load_model

    model = load_prepared()
    runner = ModelRunner(load_model(str(model.path)), gemm=gemm)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model.path), local_files_only=True)
    ids = tokenizer.encode(default_text(), add_special_tokens=False)
    cache = runner.new_cache()
    runner.prefill(cache, ids[:context], 256)
    times: dict[int, list[float]] = {w: [] for w in widths}
    for repeat in range(repeats + 1):  # pass 0 warms up
        for width in widths:
            seconds = runner.forward(cache, ids[context:context + width], keep=width).seconds
            runner.rollback(cache, context)
            if repeat:
                times[width].append(seconds)
    return {w: statistics.median(t) for w, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=8, help="fresh processes per form")
    parser.add_argument("--gemms", nargs="+", choices=("onednn", "mkl"), default=["onednn", "mkl"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 3, 5, 9, 17])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one measurement, as JSON on stdout
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.context, args.widths, args.repeats)))
        return 0
    if args.processes < 1 or args.repeats < 1 or min(args.widths) < 1 or args.context < 1:
        parser.error("--processes, --repeats, --widths and --context must be at least 1")
    print(f"command: python -m bench.gemm_processes {' '.join(argv if argv is not None else sys.argv[1:])}")
    found: dict[str, list[dict[int, float]]] = {g: [] for g in args.gemms}
    for n in range(args.processes):
        for gemm in (args.gemms if n % 2 == 0 else list(reversed(args.gemms))):
            child = [sys.executable, "-m", "bench.gemm_processes", "--child", gemm, "--context", str(args.context),
                     "--repeats", str(args.repeats), "--widths", *map(str, args.widths)]
            out = subprocess.run(child, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            medians = {int(w): s for w, s in json.loads(out).items()}
            found[gemm].append(medians)
            print(f"process {n + 1}, {gemm}: " + ", ".join(f"{w} tokens {1e3 * s:.1f} ms" for w, s in medians.items()),
                  flush=True)
    print(f"forward ms at context {args.context}, range over {args.processes} processes (max / min):")
    for gemm, runs in found.items():
        print(f"  {gemm}: " + ", ".join(
            f"{w} tokens {1e3 * min(r[w] for r in runs):.1f}-{1e3 * max(r[w] for r in runs):.1f} "
            f"({max(r[w] for r in runs) / min(r[w] for r in runs):.2f})" for w in args.widths))
    first = args.widths[0]
    print(f"each width's time / {first} token(s)' in the same process, range over processes (what a cost model's "
          "shape carries; drift of the whole machine cancels):")
    for gemm, runs in found.items():
        print(f"  {gemm}: " + ", ".join(
            f"{w} tokens {min(r[w] / r[first] for r in runs):.2f}-{max(r[w] / r[first] for r in runs):.2f}"
            for w in args.widths[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
