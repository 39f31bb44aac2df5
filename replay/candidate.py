"""Replay a candidate policy on the last N recorded requests, beside the policy in force: what ``specgate
policy explain --replay`` and ``POST /admin/replay`` answer ("what would this edit do to the traffic we
just served?"), bounded in requests and time.

The requests come from the gateway's recording (``tracing:``, gateway/tracing.py): the current file,
read as a growing file (a record being written is left out), then the rotated ones (``path.1`` newest)
while they hold the same model revision, newest requests kept. A recording carries no draft match flags
(the gateway has no model), so a ``draft_model`` pool cannot be replayed from it: such pools are left out
of both policies (unhealthy in every simulated snapshot, so ``decide()`` never picks them) and named in
the answer; ``specgate trace build`` traces carry the flags. Both policies, plain decoding and the arms
given are simulated at each load with the same seeds (replay/run.py), one process, and the sweep
stops with an error when it passes ``deadline_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from replay.book import RoundBook
from replay.choosers import PolicyChooser, Prices
from replay.report import ALL, comparisons, markdown, summarise
from replay.run import Contender, parse_arm, sweep
from policies.trace import Trace, TraceError, read_trace

MAX_REQUESTS = 5000


class ReplayTimeout(RuntimeError):
    """The replay passed its time bound."""


def recorded(path: str | Path, keep: int, last: int) -> Trace:
    """The newest ``last`` requests of a recording: ``path`` (growing), then ``path.1`` .. ``path.keep``
    while their header's revision is the current file's."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no recording yet (nothing was recorded since tracing was turned on)")
    newest = read_trace(path, growing=True)
    requests = list(newest.requests)
    for n in range(1, keep + 1):
        if len(requests) >= last:
            break
        older = path.with_name(f"{path.name}.{n}")
        if not older.exists():
            break
        trace = read_trace(older)
        if trace.header.revision != newest.header.revision:
            break
        requests = trace.requests + requests
    return Trace(newest.header, requests[-last:])


@dataclass
class CandidateReplay:
    markdown: str
    summary: dict
    excluded: list[str]
    requests: int


def replay_candidate(trace: Trace, policies: dict[str, object], costs, *, loads=("trace",), seeds: int = 3,
                     arms=("plain",), max_running: int = 16, max_total_tokens: int = 65536,
                     deadline_s: float = 60.0, source: str = "") -> CandidateReplay:
    """``policies``: name -> Policy (the one in force first, then the candidate). Greedy requests replay
    exactly; sampled ones are estimated (marked ~ in the markdown)."""
    if len(trace.requests) > MAX_REQUESTS:
        raise ValueError(f"last: at most {MAX_REQUESTS} requests per replay; ask for fewer")
    if not any(r.output_ids for r in trace.requests):
        raise ValueError("no recorded request with output tokens to replay")
    book = RoundBook(trace)
    prices = Prices(book, costs)
    excluded = sorted({name for policy in policies.values()
                       for name in PolicyChooser(policy, prices, 0, without_flags="exclude").excluded})
    contenders = [parse_arm(a, book) for a in arms]
    contenders += [Contender(name, policy=policy, without_flags="exclude") for name, policy in policies.items()]
    started = time.monotonic()

    def progress(done: int, total: int) -> None:
        if time.monotonic() - started > deadline_s:
            raise ReplayTimeout(f"the replay passed its {deadline_s:g} s bound after {done} of {total} runs; ask "
                                "for fewer requests, seeds or loads")

    results = sweep(prices, contenders, list(loads), seeds, "interleaved",
                    max_running=max_running, max_total_tokens=max_total_tokens, processes=1, progress=progress)
    names = [c.name for c in contenders]
    slices = list(dict.fromkeys(r.slice for r in trace.requests if r.output_ids))
    slice_of = {i: r.slice for i, r in enumerate(trace.requests)}.__getitem__
    slo = next(iter(policies.values())).slo
    slo_ms = (slo.ttft_ms or 2000.0, slo.tpot_ms or 150.0) if slo else (2000.0, 150.0)
    names_p = list(policies)
    pairs = comparisons(names, names_p)
    summary = summarise(results, names, list(loads), seeds, slice_of, slices, (slo_ms[0] / 1e3, slo_ms[1] / 1e3), pairs)
    meta = {"trace": source or "recording", "requests": sum(1 for r in trace.requests if r.output_ids),
            "estimated": sum(1 for r in trace.requests if not r.sampling.greedy), "mix": "recorded order",
            "seeds": seeds, "costs": "the gateway's cost model", "slo_ms": slo_ms, "command": "policy replay"}
    text = markdown(summary, meta, names, list(loads), slices)
    if excluded:
        text += (f"\nLeft out of both policies: pool(s) {', '.join(excluded)} (draft_model: the recording has no "
                 "draft match flags; a trace from specgate trace build has them).\n")
    summary["cells"] = {k: {s: v for s, v in cells.items() if s == ALL} for k, cells in summary["cells"].items()}
    return CandidateReplay(markdown=text, summary=summary, excluded=excluded, requests=meta["requests"])
