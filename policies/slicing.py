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
