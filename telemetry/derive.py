"""Speculation counters of one request, normalised once for metrics and the dashboard alike.

Workers report different subsets (backends/sglang/spec_stats.py): the embedded worker sends
per-position accepted/reached counts, SGLang sends totals and sometimes a histogram of accepted drafts
per round. Only counts are derived here, never rates: rates are computed in PromQL or in the
dashboard from the summed counts (CONTRIBUTING.md #8).
"""

from __future__ import annotations

from dataclasses import dataclass

from telemetry.labels import MAX_POSITION
from telemetry.record import RequestRecord


@dataclass(frozen=True, slots=True)
class SpecCounts:
    """``accepted_per_position[j]`` / ``reached_per_position[j]``: draft position j+1 (1-based)."""

    rounds: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    reached_per_position: tuple[int, ...]


def is_speculative(record: RequestRecord) -> bool:
    """Served with a draft: a speculative proposer and k > 0 (``bypass`` decisions are plain)."""
    return record.proposer not in ("", "none") and record.draft_tokens > 0


def positions_from_histogram(histogram: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-position (accepted, reached) from rounds-by-accepted-count ``h[i]`` (i = 0..k).

    Position j (1-based) is accepted in every round that accepted at least j drafts, and reached in
    every round that accepted at least j-1 (acceptance stops at the first rejection):
    accepted_j = sum(h[j:]), reached_j = sum(h[j-1:]).
    """
    k = len(histogram) - 1
    accepted = tuple(sum(histogram[j:]) for j in range(1, k + 1))
    reached = tuple(sum(histogram[j - 1:]) for j in range(1, k + 1))
    return accepted, reached


def spec_counts(record: RequestRecord) -> SpecCounts | None:
    """The request's speculation counters, or None when it did not speculate or the worker said nothing.

    Fallbacks, each exact for a fixed-k SGLang server: proposed drafts = rounds * k when the worker
    reports no proposed count; accepted drafts = round((accept_length - 1) * rounds) when it reports
    only the mean accept length (which counts the bonus token, hence the - 1).
    """
    rounds = record.verify_ct
    if not is_speculative(record) or not rounds:
        return None
    drafts = record.num_proposed_drafts
    if drafts is None:
        drafts = rounds * record.draft_tokens
    accepted = record.num_correct_drafts
    if accepted is None and record.accept_length is not None:
        accepted = max(0, round((record.accept_length - 1.0) * rounds))
    if record.accepted_per_position is not None and record.reached_per_position is not None:
        acc_pos, reach_pos = tuple(record.accepted_per_position), tuple(record.reached_per_position)
    elif record.correct_drafts_histogram:
        acc_pos, reach_pos = positions_from_histogram(record.correct_drafts_histogram)
    else:
        acc_pos, reach_pos = (), ()
    if accepted is None:
        accepted = sum(acc_pos)
    return SpecCounts(rounds=rounds, draft_tokens=drafts, accepted_tokens=accepted,
                      accepted_per_position=acc_pos[:MAX_POSITION], reached_per_position=reach_pos[:MAX_POSITION])
