"""Fitting the serving path's cost into replay's cost model: ``serving_s`` (per round, from plain requests served
one at a time) and ``serving_concurrent_s`` / ``serving_streams_s`` (per round at a stream count, by bisection
until replay's plain TPOT p50 equals a serving run's). Used by ``bench.serving_cost`` and ``bench.replay_fidelity``."""

from __future__ import annotations

import statistics

from msgspec import structs

from replay.book import PLAIN, RoundBook
from replay.choosers import Prices
from replay.profile import profile
from replay.report import percentile
from replay.run import parse_arm, sweep


def replayed_tpot(costs, prompt_tokens: int, output_tokens: int) -> float:
    """TPOT of a plain request alone, as replay prices it: its rounds after the first (the first token is the
    TTFT), each a one-token forward at its cached context plus the per-round seconds outside it."""
    rounds = ((0,) * output_tokens,) * 3
    p = profile(costs, prompt_tokens, output_tokens, PLAIN, rounds)
    return sum(p.serial[1:] + p.alone[1:]) / (output_tokens - 1)


def fit(costs, measured: list[tuple[int, int, float]]) -> tuple[float, list[float]]:
    """(serving_s, each request's gap): ``measured`` holds (prompt tokens, output tokens, TPOT seconds) per request;
    the gap is measured TPOT minus replay's on ``costs`` without serving_s (one streamed round per plain token)."""
    base = structs.replace(costs, serving_s=0.0)
    gaps = [tpot - replayed_tpot(base, prompt, output) for prompt, output, tpot in measured if output >= 2]
    if not gaps:
        raise ValueError("no request produced two tokens or more: nothing to measure TPOT on")
    return max(0.0, statistics.median(gaps)), gaps


def fit_serving_concurrent(run: dict, book: RoundBook, costs, load: str, order, steps: int = 40,
                           streams: int | None = None):
    """The cost model with ``serving_concurrent_s`` set so that replay's plain TPOT p50 at ``load`` (the run's
    order) equals the measured p50 of the run's plain requests there: bisection between 0 and 1 s (replay's TPOT
    grows with it); None when the run has no plain requests at ``load``. ``streams``: set the ``serving_streams``
    table's entry at that stream count instead (added, or replaced; the other entries kept)."""
    def with_value(value: float):
        if streams is None:
            return structs.replace(costs, serving_concurrent_s=value)
        table = dict(zip(costs.serving_streams, costs.serving_streams_s)) | {streams: value}
        counts = sorted(table)
        return structs.replace(costs, serving_streams=counts, serving_streams_s=[table[n] for n in counts])

    measured = [r["tpot_s"] for r in run["requests"]
                if r["arm"] == "plain" and r["load"] == load and r["ok"] and r["tpot_s"]]
    if not measured:
        return None
    target = percentile(measured, 50)
    plain = parse_arm("plain", book)
    max_running = run.get("settings", {}).get("max_running_requests", 16)  # the worker's flag, as main replays

    def replayed(value: float) -> float:
        trial = with_value(value)
        served = sweep(Prices(book, trial), [plain], [load], 1, "by-slice", max_running=max_running,
                       max_total_tokens=65536, processes=1, order=order)[(plain.name, load, 0)]
        return percentile([s.tpot for s in served if s.tpot], 50)

    low, high = 0.0, 1.0
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (middle, high) if replayed(middle) < target else (low, middle)
    value = round((low + high) / 2, 6)
    name = "serving_concurrent_s" if streams is None else f"serving_streams_s at {streams} streams"
    print(f"{name} fitted on {len(measured)} plain {load} requests: {value * 1e3:.1f} ms per round "
          f"(replayed TPOT p50 {replayed(value) * 1e3:.1f} ms, measured {target * 1e3:.1f} ms)\n")
    return with_value(value)
