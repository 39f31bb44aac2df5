"""The seeded request sample of the benchmarks (bench/workloads.py), on the workloads (the sample shipped in
workloads/ unless $SPECGATE_WORKLOADS names the full sets)."""

from __future__ import annotations

import random

import pytest

from bench.workloads import DEFAULT_ROOT, SLICES, load_all, sample


def _ids(items) -> list[str]:
    return [i.id for i in items]


def test_a_subset_of_slices_draws_the_same_requests_as_all_slices():
    full = sample(DEFAULT_ROOT, per_slice=4, seed=3)
    for chosen in (("code_edit",), ("prose", "long_context", "code_edit"), ("long_context", "code")):
        sub = sample(DEFAULT_ROOT, per_slice=4, seed=3, slices=chosen)
        assert _ids(sub) == [i.id for s in chosen for i in full if i.slice == s]


def test_the_sample_of_all_slices_is_the_one_earlier_runs_drew():
    # the draw before subsets were made independent: one RNG over the slices in order; runs kept in
    # docs/runs (all five slices) must be reproducible at this commit
    items = load_all(DEFAULT_ROOT)
    rng = random.Random(0)
    before = [i for s in SLICES for i in rng.sample(items[s], min(16, len(items[s])))]
    assert _ids(sample(DEFAULT_ROOT, per_slice=16, seed=0)) == _ids(before)
    assert len(before) == 16 * len(SLICES)


def test_an_unknown_slice_is_refused_by_name():
    with pytest.raises(ValueError, match=r"slices: unknown \['poetry'\]"):
        sample(DEFAULT_ROOT, per_slice=1, slices=("prose", "poetry"))
