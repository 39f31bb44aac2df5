"""Paired TPOT of one arm of a serving-benchmark run against others, per slice and over every prompt of a load.

    python -m bench.serve_paired RUN --arm ngram-k16-beta --against plain ngram-k2 ngram-k4 [--rep N]

RUN is a ``specgate bench serve`` result (serve.json or serve.json.gz). Each cell: the geometric mean over
the prompts of the arm's TPOT over the other arm's on the same prompt (replicates averaged per prompt), with
a 95% interval over prompts (``bench.serve.report.paired_tpot_ratio``; no between-run term: a single run's
interval over prompts, read it as such). ``--rep N``: only replicate N's requests (0 is the first), e.g. a run whose
later replicates are not replicates (a warm arm's tree held the earlier answers: ``bench.serve.arms``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from bench.serve.report import paired_tpot_ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_paired", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="serve.json or serve.json.gz of specgate bench serve")
    parser.add_argument("--arm", required=True, help="the arm compared")
    parser.add_argument("--against", nargs="+", required=True, help="the arms it is compared with")
    parser.add_argument("--rep", type=int, default=None, help="only this replicate (0: the first); default: all")
    args = parser.parse_args(argv)
    raw = gzip.open(args.run).read() if args.run.suffix == ".gz" else args.run.read_bytes()
    run = json.loads(raw)
    arms, loads, slices = run["settings"]["arms"], run["settings"]["loads"], run["settings"]["slices"]
    for name in (args.arm, *args.against):
        if name not in arms:
            print(f"error: arm {name!r} is not in the run (it has: {', '.join(arms)})", file=sys.stderr)
            return 2
    reps = run["settings"].get("repeats", 1)
    requests = run["requests"]
    if args.rep is not None:
        if not 0 <= args.rep < reps:
            print(f"error: --rep {args.rep}: the run has replicates 0 to {reps - 1}", file=sys.stderr)
            return 2
        requests, reps = [r for r in requests if r.get("rep", 0) == args.rep], 1
    for load in loads:
        which = f"replicate {args.rep}" if args.rep is not None else f"{reps} repeat(s) averaged per prompt"
        print(f"\n{load}: paired geomean TPOT ratio [95% over prompts], {which}")
        print("| ratio | " + " | ".join(slices) + " | all |")
        print("|---" * (len(slices) + 2) + "|")
        for other in args.against:
            cells = []
            for slice_ in (*slices, None):
                ci = paired_tpot_ratio(requests, args.arm, other, load, slice_)
                cells.append("-" if ci is None else f"{ci[0]:.3f} [{ci[1]:.3f}, {ci[2]:.3f}]")
            print(f"| {args.arm} / {other} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
