"""Assign a request to a workload slice: the first slice whose conditions all hold (the last, default
slice has none)."""

from __future__ import annotations

from policies.compiled import Ctx, compiled
from policies.features import RequestFeatures
from policies.schema import Policy


def classify(policy: Policy, features: RequestFeatures) -> tuple[str, int]:
    """(slice name, index of the matching slice entry)."""
    comp = compiled(policy)
    ctx = Ctx(features, "", None, comp)
    for i, (name, preds) in enumerate(comp.slices):
        if all(pred(ctx) for _, pred in preds):
            return name, i
    last = len(comp.slices) - 1  # unreachable for a loaded policy (a default slice is required)
    return comp.slices[last][0], last


def needs_code_score(policy: Policy, features: RequestFeatures) -> bool:
    """Whether deciding a request with these features (``code_score`` not yet computed) reads ``code_score``: a
    rule's condition names it, or slicing reaches a slice that names it before an earlier one matches. With the
    default policy a tool call or a long prompt never does, and a long prompt's score is the costly one."""
    comp = compiled(policy)
    if comp.rules_read_code:
        return True
    ctx = Ctx(features, "", None, comp)
    for reads, (_, preds) in zip(comp.slice_reads_code, comp.slices):
        if reads:
            return True
        if all(pred(ctx) for _, pred in preds):
            return False
    return False
