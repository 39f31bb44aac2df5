"""From per-request results to the cells of the result file (arm x load point x slice).

Goodput is DistServe's: requests per second of the cell's wall time whose TTFT and TPOT both met the
default policy's SLO; attainment is the fraction of requests that did. Accept length = committed
tokens / verify rounds over the cell's speculated requests (a rate from counters, not a mean of
per-request means). Identity compares each request's streamed text (content and tool calls) with the
plain arm's answer to the same request at the same load point.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from bench.serve.analyse import explored
from bench.serve.client import Result
from replay.report import percentile  # one percentile rule for measured and replayed cells

QUANTILES = (50, 90, 99)


def _ms(values: Iterable[float | None]) -> dict[str, float | None]:
    xs = [v * 1e3 for v in values if v is not None]
    return {f"p{q}": (round(p, 2) if (p := percentile(xs, q)) is not None else None) for q in QUANTILES}


def cell(results: list[Result], wall_s: float, peak_rss_mb: float,
         plain: dict[str, str] | None) -> dict:
    ok = [r for r in results if r.ok]
    met = sum(1 for r in results if r.slo_met)
    tokens = sum(r.completion_tokens for r in ok)
    spec = [r for r in ok if r.verify_rounds and r.proposer not in (None, "none")]
    rounds = sum(r.verify_rounds or 0 for r in spec)
    compared = [r for r in ok if plain is not None and r.item in plain]
    return {
        "requests": len(results), "ok": len(ok), "errors": [r.error for r in results if not r.ok],
        "wall_s": round(wall_s, 3),
        "ttft_ms": _ms(r.ttft_s for r in ok), "tpot_ms": _ms(r.tpot_s for r in ok),
        "output_tokens": tokens, "output_tok_s": round(tokens / wall_s, 3) if wall_s else None,
        "slo_met": met, "slo_attainment": round(met / len(results), 4) if results else None,
        "goodput_rps": round(met / wall_s, 4) if wall_s else None,
        "accept_length": round(sum(r.completion_tokens for r in spec) / rounds, 3) if rounds else None,
        "decisions_by_rule": dict(Counter(r.rule or "?" for r in ok)),
        "choices": dict(Counter(f"{r.pool}:{r.draft_tokens}" for r in ok)),
        "gateway_slices": dict(Counter(r.gateway_slice or "?" for r in ok)),
        "peak_rss_mb": peak_rss_mb,
        "identical_to_plain": sum(1 for r in compared if r.text == plain[r.item]) if plain is not None else None,
        "compared_to_plain": len(compared) if plain is not None else None,
        "not_identical": [r.item for r in compared if r.text != plain[r.item]] if plain is not None else None,
    }


def learning_cost(trace: list[Result], warm_tpot_ms: dict[str, float | None],
                  warm_choice: dict[str, str | None] | None = None, tolerance: float = 0.05, window: int = 3) -> dict:
    """Cost of learning over the warm-up pass (a cold learner), per slice, counted in requests over all
    slices (as the learner sees them) and in the slice's own requests:

    - ``requests``: until the slice's rolling mean TPOT over its last ``window`` requests came within
      ``tolerance`` of the warm arm's p50 TPOT (confounded by prompts: warm-up and measured prompts differ);
    - ``settled``: from which request on every decision for the slice that was not an exploration is the
      warm arm's choice (``warm_choice``, pool:k, its most frequent at the reference load). ``None`` = not
      within the warm-up."""
    out: dict[str, dict] = {}
    seen: dict[str, list[float]] = {}
    for n, r in enumerate(trace, 1):
        if not r.ok or r.tpot_s is None:
            continue
        xs = seen.setdefault(r.slice, [])
        xs.append(r.tpot_s * 1e3)
        target = warm_tpot_ms.get(r.slice)
        if r.slice in out or target is None or len(xs) < window:
            continue
        mean = sum(xs[-window:]) / window
        if mean <= target * (1 + tolerance):
            out[r.slice] = {"requests": n, "slice_requests": len(xs), "rolling_tpot_ms": round(mean, 2),
                            "warm_tpot_p50_ms": target}
    result = {s: out.get(s, {"requests": None, "slice_requests": len(seen.get(s, [])),
                             "warm_tpot_p50_ms": warm_tpot_ms.get(s)})
              for s in sorted(set(seen) | set(warm_tpot_ms))}
    for s, choice in (warm_choice or {}).items():
        result.setdefault(s, {"requests": None, "slice_requests": 0, "warm_tpot_p50_ms": warm_tpot_ms.get(s)})
        result[s].update(warm_choice=choice, **_settled(trace, s, choice))
    return result


def _settled(trace: list[Result], slice_: str, choice: str | None) -> dict:
    """The first request (overall, and within the slice) from which every non-exploring decision of the
    slice was ``choice``."""
    settled: tuple[int, int] | None = None
    k = 0
    for n, r in enumerate(trace, 1):
        if r.slice != slice_ or not r.ok:
            continue
        k += 1
        if explored(r.explored, r.reason):
            continue
        if f"{r.pool}:{r.draft_tokens}" != choice:
            settled = None
        elif settled is None:
            settled = (n, k)
    return {"settled": settled[0] if settled else None, "settled_slice_requests": settled[1] if settled else None}
