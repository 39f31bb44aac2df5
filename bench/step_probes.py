"""Two checks of how replay prices an engine step, on the embedded engine's runner (timing fidelity).

    python -m bench.step_probes [--repeats 7] [--threads 2]

- **A step that mixes rounds with a prefill chunk.** Replay prices it as its rounds plus its chunk
  (replay/profile.step_s). Measured: B one-token rounds at context 256, a 256-token chunk after 512
  cached tokens, each alone, and both in ONE ``forward_batch``; printed as the one forward over the sum.
- **A forward after the worker sat idle.** Under Poisson arrivals a lone request often starts on an idle
  engine; replay prices its rounds as if back to back. Measured: a one-token forward at context 256 after
  sleeping 0, 0.05, 0.5 and 2 s, and the one after it, beside back-to-back ones.

Every figure is a median over ``--repeats`` (after one warm-up), on the real model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

CONTEXT, CHUNK_AT, CHUNK = 256, 512, 256
GAPS = (0.0, 0.05, 0.5, 2.0)


class Probe:
    """The runner's forwards as the engine makes them (``forward_batch``), each timed and rolled back."""

    def __init__(self, runner, context: int = CONTEXT, chunk_at: int = CHUNK_AT, chunk: int = CHUNK) -> None:
        self.runner, self.context, self.chunk_at, self.chunk = runner, context, chunk_at, chunk
        vocab = runner.embed.shape[0]
        self.ids = [(1000 + i) % vocab for i in range(chunk_at + chunk)]  # any ids: the cost does not depend on them

    def cache_at(self, n: int):
        from backends.engine.runner import Feed

        cache = self.runner.new_cache(self.chunk_at + self.chunk + 8)
        self.runner.forward_batch([Feed(cache, self.ids[:n], 1)])
        return cache

    def _median_s(self, feeds_of, repeats: int) -> float:
        times = []
        for repeat in range(repeats + 1):  # the first is a warm-up
            feeds, undo = feeds_of()
            start = time.perf_counter()
            self.runner.forward_batch(feeds)
            if repeat:
                times.append(time.perf_counter() - start)
            undo()
        return statistics.median(times)

    def mixed_step(self, batch: int, repeats: int) -> tuple[float, float, float]:
        """Median seconds of ``batch`` one-token rounds alone, the chunk alone, and both in one forward."""
        from backends.engine.runner import Feed

        runner, ids, context, at = self.runner, self.ids, self.context, self.chunk_at
        decoding, prefilling = [self.cache_at(context) for _ in range(batch)], self.cache_at(at)

        def rounds():
            return ([Feed(c, ids[context:context + 1], 1) for c in decoding],
                    lambda: [runner.rollback(c, context) for c in decoding])

        def chunk():
            return [Feed(prefilling, ids[at:at + self.chunk], 1)], lambda: runner.rollback(prefilling, at)

        def both():
            (a, undo_a), (b, undo_b) = rounds(), chunk()
            return a + b, lambda: (undo_a(), undo_b())

        r, c, m = (self._median_s(f, repeats) for f in (rounds, chunk, both))
        return r, c, m

    def after_idle(self, gap: float, repeats: int, sleep=time.sleep) -> tuple[float, float, float]:
        """Median seconds of a one-token forward right after ``gap`` idle seconds, of the one after it, and of
        back-to-back ones."""
        from backends.engine.runner import Feed

        cache, ids, context = self.cache_at(self.context), self.ids, self.context

        def one() -> float:
            start = time.perf_counter()
            self.runner.forward_batch([Feed(cache, ids[context:context + 1], 1)])
            seconds = time.perf_counter() - start
            self.runner.rollback(cache, context)
            return seconds

        for _ in range(3):
            one()
        first, second, steady = [], [], []
        for _ in range(repeats):
            sleep(gap)
            first.append(one())
            second.append(one())
            steady += [one() for _ in range(3)]
        return statistics.median(first), statistics.median(second), statistics.median(steady)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_probes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the worker's default: the cores)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="rounds beside the chunk")
    args = parser.parse_args(argv)

    import torch

    from backends.engine.model_store import load_prepared
    from backends.engine.runner import ModelRunner, load_model

    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        report(Probe(ModelRunner(load_model(load_prepared().path))), args.batches, args.repeats)
    return 0


def report(probe: Probe, batches, repeats: int, gaps=GAPS, sleep=time.sleep) -> None:
    print(f"mixed steps: B one-token rounds at context {probe.context} and a {probe.chunk}-token chunk after "
          f"{probe.chunk_at}")
    for batch in batches:
        r, c, m = probe.mixed_step(batch, repeats)
        print(f"  B={batch}: rounds {r * 1e3:.1f} ms, chunk {c * 1e3:.1f} ms, sum {(r + c) * 1e3:.1f} ms, one "
              f"forward holding both {m * 1e3:.1f} ms ({m / (r + c):.2f}x the sum)")
    print(f"a one-token forward at context {probe.context} after an idle gap")
    for gap in gaps:
        first, second, base = probe.after_idle(gap, repeats, sleep)
        print(f"  gap {gap:.2f} s: first {first * 1e3:.1f} ms ({first / base:.2f}x), second {second * 1e3:.1f} ms, "
              f"back to back {base * 1e3:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
