"""Merging decayed sums across replicas (policies/shared_sums.py): two learners that each saw part of a stream,
merged, hold exactly what one learner that saw all of it holds; republishing never adds twice."""

from __future__ import annotations

import math

import pytest

from policies.accept import AcceptanceSummary
from policies.schema import Learning
from policies.shared_sums import Merger, field_of, from_wire, merge, sum_counts, to_wire
from policies.snapshot import ArmSummary
from policies.stats import LearningState
from tests.policies.shared_sums_stream import stream as _stream


def _close(a, b) -> None:
    assert type(a) is type(b)
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, tuple):
            assert len(x) == len(y) and all(math.isclose(u, v, rel_tol=1e-9, abs_tol=1e-9) for u, v in zip(x, y))
        else:
            assert math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9), name


def test_two_replicas_merged_equal_one_learner_that_saw_everything():
    learning = Learning(half_life_s=60.0)
    one, a, b = LearningState(learning), LearningState(learning), LearningState(learning)
    for i, outcome in enumerate(_stream(400)):
        one.record(outcome)
        (a if i % 2 else b).record(outcome)
    merger = Merger()
    merger.set_others([b.tables()], learning.half_life_s)
    merged = merger.tables(a.tables(), learning.half_life_s)
    for table in ("acceptance", "arms", "gaps"):
        assert set(merged[table]) == set(one.tables()[table])
        for key, summary in one.tables()[table].items():
            _close(summary, merged[table][key])


def test_merge_rescales_the_older_sum_to_the_newer_reference_time():
    old = ArmSummary(t_ref=0.0, w=4.0, sy=8.0, syy=16.0, ever=4.0)
    new = ArmSummary(t_ref=10.0, w=1.0, sy=1.0, syy=1.0, ever=1.0)
    both = merge(old, new, half_life_s=10.0)
    assert both == ArmSummary(t_ref=10.0, w=3.0, sy=5.0, syy=9.0, ever=5.0)
    assert merge(new, old, half_life_s=10.0) == both
    acc = merge(AcceptanceSummary(t_ref=0.0, requests=2, reached=(2.0,), accepted=(2.0,)),
                AcceptanceSummary(t_ref=10.0, requests=1, reached=(1.0, 1.0), accepted=(1.0, 0.0)), 10.0)
    assert acc.requests == 2.0 and acc.reached == (2.0, 1.0) and acc.accepted == (2.0, 0.0)


def test_wire_round_trip_shifts_the_reference_time_by_the_clock_offset():
    summary = ArmSummary(t_ref=5.0, w=1.0, sy=2.0, syy=3.0, ever=1.0)
    raw = to_wire(summary, offset=1000.0)
    table, key, back = from_wire(field_of("arms", "code|0|0|none").encode(), raw, offset=990.0)
    assert (table, key) == ("arms", "code|0|0|none") and back.t_ref == pytest.approx(15.0) and back.w == 1.0
    assert from_wire("unknown\x1fk", raw, 0.0) is None
    assert b"code" not in raw  # only numbers in the value; the labels are the field


def test_republishing_the_same_sums_does_not_count_them_twice():
    learning = Learning(half_life_s=60.0)
    a, b = LearningState(learning), LearningState(learning)
    for i, outcome in enumerate(_stream(50)):
        (a if i % 2 else b).record(outcome)
    merger = Merger()
    merger.set_others([b.tables()], 60.0)
    first = merger.tables(a.tables(), 60.0)
    merger.set_others([b.tables()], 60.0)  # b flushed again (a store restart, a reconnect): replaces
    again = merger.tables(a.tables(), 60.0)
    assert first == again


def test_sum_counts_adds_per_key_and_leaves_out_what_is_not_in_flight():
    own, a, b = {"x": 1, "y": 2}, {"y": 3, "z": 1}, {"x": -1, "w": 0}
    assert sum_counts(own, a, b) == {"y": 5, "z": 1}  # x: 1 - 1 and w: 0 are nothing in flight
    assert sum_counts() == {} and sum_counts(own) == own and sum_counts(own) is not own
