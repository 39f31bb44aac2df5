"""`specgate bench serve --mix interleaved`: one cell per load point whose requests are every slice's, in one
seeded order (what a front door serves, and what replay's default mix simulates)."""

from __future__ import annotations

import argparse

from bench.serve.client import Result
from bench.serve.run import MIX_SLICE, MIXED, Bench, mixed, relabelled
from bench.workloads import SLICES, WorkItem


def items() -> list[WorkItem]:
    return [WorkItem(id=f"{s}-{n}", slice=s, messages=[{"role": "user", "content": f"{s} {n}"}], meta={"n": n})
            for s in SLICES for n in range(4)]


def test_every_request_once_in_one_seeded_order_keeping_its_own_slice():
    given = items()
    out = mixed(given, seed=0)
    assert sorted(i.id for i in out) == sorted(i.id for i in given)
    assert {i.slice for i in out} == {MIXED}
    assert all(i.meta == {"n": int(i.id.rsplit("-", 1)[1]), MIX_SLICE: i.id.rsplit("-", 1)[0]} for i in out)
    assert [i.id for i in mixed(given, seed=0)] == [i.id for i in out]  # deterministic
    assert [i.id for i in mixed(given, seed=1)] != [i.id for i in out]
    runs = sum(a.meta[MIX_SLICE] != b.meta[MIX_SLICE] for a, b in zip(out, out[1:]))
    assert runs > len(SLICES)  # interleaved, not served a slice after another
    assert given[0].slice == SLICES[0] and "workload_slice" not in given[0].meta  # the sample is not changed


def test_an_interleaved_run_has_one_cell_per_load_and_results_name_their_own_slice():
    args = argparse.Namespace(slices=list(SLICES), loads=["c4"])
    assert Bench(args, mixed(items(), 0), [], "sha256:x", {}).slices == [MIXED]
    assert Bench(args, items(), [], "sha256:x", {}).slices == list(SLICES)
    r = Result(arm="plain", load="c4", slice=MIXED, item="code-0", start_s=0.0, workload_slice="code")
    assert r.as_dict()["workload_slice"] == "code"


def test_the_warm_up_keeps_its_order_and_is_labelled_as_the_cells_it_warms():
    """The cost-of-learning table compares the warm-up with the cells of its slice: interleaved, ``mixed``."""
    given = items()
    out = relabelled(given)
    assert [i.id for i in out] == [i.id for i in given]
    assert {i.slice for i in out} == {MIXED} and [i.meta[MIX_SLICE] for i in out] == [i.slice for i in given]
