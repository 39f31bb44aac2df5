"""One speculation-statistics value per request, whatever SGLang release produced it.

SGLang reports per-request speculation counters in ``meta_info`` (``/generate``) and in
``sglext.spec_tokens_details`` (OpenAI endpoints), under names that changed across releases:

==========================  =================================  ============================
quantity                    0.5.x (canonical)                  older
==========================  =================================  ============================
verification rounds         spec_verify_ct                     spec_verify_ct
accepted drafts (total)     spec_num_correct_drafts            spec_accepted_drafts,
                                                               spec_accept_token_num
proposed drafts (total)     spec_num_proposed_drafts           spec_proposed_drafts,
                                                               spec_draft_token_num
rounds by #accepted drafts  spec_correct_drafts_histogram      spec_accept_histogram
==========================  =================================  ============================

Canonical names win over aliases. ``accept_length`` is completion_tokens / verify_ct, i.e. it
INCLUDES the bonus/recovered token (docs/architecture.md, "Vocabulary"); when the worker did not send it we derive
it from ``(num_correct_drafts + verify_ct) / verify_ct``, which is the same quantity when no stop cut
a round short. The per-position lists are specgate's own extras (accepted count and reached count of
draft position j, 0-based), so the policy can estimate a_j = accepted[j] / reached[j].
"""

from __future__ import annotations

from typing import Any

import msgspec

from backends.sglang.openai_wire import SglExt, SpecTokensDetails
from backends.sglang.wire import MetaInfo


class SpecStats(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Normalised per-request speculation counters. ``None`` = the worker did not say."""

    verify_ct: int
    accept_length: float | None = None
    accept_rate: float | None = None
    num_correct_drafts: int | None = None
    num_proposed_drafts: int | None = None
    histogram: tuple[int, ...] | None = None  # rounds that accepted exactly i drafts, i = 0..k
    accepted_per_position: tuple[int, ...] | None = None
    proposed_per_position: tuple[int, ...] | None = None
    reached_per_position: tuple[int, ...] | None = None
    draft_s: float | None = None
    verify_s: float | None = None
    plain_ratio: float | None = None  # specgate's embedded worker: plain decoding's estimated time over this one's
    neighbour_s: float | None = None  # specgate's embedded worker: seconds its drafts added to the others' steps


def _first(*values: Any) -> Any:
    for value in values:
        if value is not None:
            return value
    return None


def _as_tuple(values: list[int] | None) -> tuple[int, ...] | None:
    return None if values is None else tuple(values)


def spec_stats_from(source: MetaInfo | SpecTokensDetails) -> SpecStats | None:
    """Normalise the spec_* fields of a final ``meta_info`` or a ``spec_tokens_details``.

    Returns None when the worker ran no speculation for the request (no ``spec_verify_ct``, or 0).
    """
    verify_ct = source.spec_verify_ct
    if not verify_ct:
        return None
    correct = _first(source.spec_num_correct_drafts, source.spec_accepted_drafts,
                     source.spec_accept_token_num)
    proposed = _first(source.spec_num_proposed_drafts, source.spec_proposed_drafts,
                      source.spec_draft_token_num)
    histogram = _first(source.spec_correct_drafts_histogram, source.spec_accept_histogram)
    if correct is None and histogram is not None:
        correct = sum(i * count for i, count in enumerate(histogram))
    accept_length = source.spec_accept_length
    if accept_length is None and correct is not None:
        accept_length = (correct + verify_ct) / verify_ct
    accept_rate = source.spec_accept_rate
    if accept_rate is None and correct is not None and proposed:
        accept_rate = correct / proposed
    return SpecStats(
        verify_ct=verify_ct,
        accept_length=accept_length,
        accept_rate=accept_rate,
        num_correct_drafts=correct,
        num_proposed_drafts=proposed,
        histogram=_as_tuple(histogram),
        accepted_per_position=_as_tuple(source.spec_accepted_per_position),
        proposed_per_position=_as_tuple(source.spec_proposed_per_position),
        reached_per_position=_as_tuple(source.spec_reached_per_position),
        draft_s=source.spec_draft_s,
        verify_s=source.spec_verify_s,
        plain_ratio=source.specgate_plain_ratio,
        neighbour_s=source.specgate_neighbour_s,
    )


def spec_stats_from_sglext(sglext: SglExt | None, choice_index: int = 0) -> SpecStats | None:
    """Spec stats of one choice of an OpenAI response (a list when the request had ``n > 1``)."""
    if sglext is None or sglext.spec_tokens_details is None:
        return None
    details = sglext.spec_tokens_details
    if isinstance(details, list):
        if choice_index >= len(details):
            return None
        details = details[choice_index]
    return spec_stats_from(details)
