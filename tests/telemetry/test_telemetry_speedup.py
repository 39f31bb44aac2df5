"""The dashboard's realised-speedup table: exact ratios from hand-made records, load buckets, the window."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.telemetry_views import policy_view
from policies.load import load_policy
from policies.schema import Learning
from policies.snapshot import SnapshotData
from telemetry import RequestRecord, Telemetry
from telemetry.series import History
from telemetry.speedup import LOAD_BUCKETS, load_edge, load_label

POLICY = Path(__file__).with_name("policy.yaml")
SPEC = dict(pool="ngram", proposer="ngram", rule="code-ngram", draft_tokens=4)
PLAIN = dict(pool="plain", proposer="none", rule="learned")


pytestmark = pytest.mark.usefixtures("quiet_logs")


def rec(i: int, *, tpot_s: float, slice_: str = "code", route: str = "ide", concurrency: int | None = 1,
        completion_tokens: int = 21, at: float = 1000.0, **kw) -> RequestRecord:
    served = {**(SPEC if kw.pop("spec", True) else PLAIN), **kw}
    return RequestRecord(request_id=f"r{i}", route=route, slice=slice_, completion_tokens=completion_tokens,
                         tpot_s=tpot_s, tpot_source="worker", concurrency=concurrency, timestamp=at, **served)


def table(telemetry: Telemetry, now: float = 1010.0, route: str = "*") -> dict[tuple[str, str], dict]:
    return {(c["slice"], c["load"]): c for c in telemetry.dashboard_data(now=now)["speedup"]["cells"]
            if c["route"] == route}


def test_edges_are_the_learners():
    assert LOAD_BUCKETS == tuple(SnapshotData().buckets) == tuple(Learning().concurrency_buckets)
    assert [load_edge(c, LOAD_BUCKETS) for c in (0, 1, 2, 3, 4, 5, 8, 9, 64, 65)] == \
        [1, 1, 2, 4, 4, 8, 8, 16, 64, None]
    assert [load_label(e, LOAD_BUCKETS) for e in (1, 2, 4, 8, 64, None)] == ["1", "2", "3-4", "5-8", "33-64", ">64"]


def test_exact_ratio_and_a_plain_only_cell(policy):
    telemetry = Telemetry(policy, history=History(width_s=5.0, size=10))
    for i in range(10):
        telemetry.observe(rec(i, tpot_s=0.040, spec=False))  # plain 40 ms x 10, code, c1
        telemetry.observe(rec(100 + i, tpot_s=0.020))  # speculative 20 ms x 10, code, c1
        telemetry.observe(rec(200 + i, tpot_s=0.040, spec=False, concurrency=6, route="chat"))  # plain only, c5-8
    data = telemetry.dashboard_data(now=1010.0)["speedup"]
    assert data["edges"] == [1, 2, 4, 8, 16, 32, 64]
    assert data["loads"] == [{"load": "1", "max": 1}, {"load": "5-8", "max": 8}]
    cells = table(telemetry)
    code = cells[("code", "1")]
    assert (code["spec_n"], code["plain_n"], code["spec_tokens"], code["plain_tokens"]) == (10, 10, 200, 200)
    assert code["spec_tpot_s"] == pytest.approx(0.020) and code["plain_tpot_s"] == pytest.approx(0.040)
    assert code["speedup"] == pytest.approx(2.0)
    lonely = cells[("code", "5-8")]
    assert (lonely["spec_n"], lonely["plain_n"], lonely["spec_tpot_s"], lonely["speedup"]) == (0, 10, None, None)
    # per route as well as over all routes ("*")
    assert table(telemetry, route="ide")[("code", "1")]["speedup"] == pytest.approx(2.0)
    assert ("code", "5-8") not in table(telemetry, route="ide")
    assert table(telemetry, route="chat")[("code", "5-8")]["plain_n"] == 10


def test_a_cell_served_only_speculatively_is_measured_against_the_workers_plain_estimates(policy):
    """Where auto learned that plain loses, it serves no plain request, and the measured ratio has no plain
    side; the worker's estimate of plain decoding for the same tokens gives the cell's speedup, token-weighted
    over the requests that carry one (a real SGLang server sends none: those do not count)."""
    telemetry = Telemetry(policy)
    telemetry.observe(rec(1, tpot_s=0.020, completion_tokens=11, plain_tpot_s=0.050))  # 10 gaps: 0.2 s vs 0.5 s
    telemetry.observe(rec(2, tpot_s=0.030, completion_tokens=31, plain_tpot_s=0.045))  # 30 gaps: 0.9 s vs 1.35 s
    telemetry.observe(rec(3, tpot_s=0.010, completion_tokens=11))  # no estimate
    cell = table(telemetry)[("code", "1")]
    assert (cell["spec_n"], cell["plain_n"], cell["est_n"], cell["speedup"]) == (3, 0, 2, None)
    assert cell["estimated_speedup"] == pytest.approx((0.5 + 1.35) / (0.2 + 0.9))
    # a plain request in the cell: the measured ratio is there; the estimate stays beside it
    telemetry.observe(rec(4, tpot_s=0.040, completion_tokens=11, spec=False))
    cell = table(telemetry)[("code", "1")]
    assert cell["speedup"] == pytest.approx(0.040 / ((0.2 + 0.9 + 0.1) / 50))
    assert cell["estimated_speedup"] == pytest.approx((0.5 + 1.35) / (0.2 + 0.9))


def test_token_weighted_and_what_does_not_count(policy):
    telemetry = Telemetry(policy)
    # plain: 10 gaps at 30 ms and 30 gaps at 50 ms -> (0.3 + 1.5) / 40 = 45 ms per token
    telemetry.observe(rec(1, tpot_s=0.030, completion_tokens=11, spec=False, concurrency=3))
    telemetry.observe(rec(2, tpot_s=0.050, completion_tokens=31, spec=False, concurrency=4))
    telemetry.observe(rec(3, tpot_s=0.015, completion_tokens=101, concurrency=3))
    # none of these counts: a bypass (k = 0) counts as plain, the others say nothing about TPOT or load
    telemetry.observe(rec(4, tpot_s=0.045, completion_tokens=41, draft_tokens=0, concurrency=4))
    telemetry.observe(rec(5, tpot_s=0.001, concurrency=None))
    telemetry.observe(rec(6, tpot_s=0.001, completion_tokens=1))
    telemetry.observe(rec(7, tpot_s=0.001, status="upstream_error", concurrency=4))
    telemetry.observe(RequestRecord(request_id="8", route="ide", slice="code", completion_tokens=20,
                                    concurrency=4, timestamp=1000.0, **SPEC))  # no TPOT
    cell = table(telemetry)[("code", "3-4")]
    assert (cell["spec_n"], cell["plain_n"], cell["plain_tokens"]) == (1, 3, 80)
    assert cell["plain_tpot_s"] == pytest.approx((0.3 + 1.5 + 0.045 * 40) / 80)
    assert cell["speedup"] == pytest.approx(cell["plain_tpot_s"] / 0.015)
    assert set(table(telemetry)) == {("code", "3-4")}


def test_window_follows_the_history_and_edges_follow_the_policy(policy):
    telemetry = Telemetry(policy, history=History(width_s=5.0, size=4))
    telemetry.observe(rec(1, tpot_s=0.02, at=1000.0))
    telemetry.observe(rec(2, tpot_s=0.04, spec=False, at=1000.0))
    data = telemetry.dashboard_data(now=1012.0)["speedup"]
    assert data["window_s"] == 15.0 and len(data["cells"]) == 2  # route "ide" and all routes
    assert telemetry.dashboard_data(now=1100.0)["speedup"]["cells"] == []  # fell out of the 4 buckets
    text = POLICY.read_text() + "\nlearning: {concurrency_buckets: [16, 1, 4]}\n"  # sorted by the view
    telemetry.set_policy(policy_view(load_policy(text, "policy.yaml")), version="v2", reload_ok=True)
    telemetry.observe(rec(3, tpot_s=0.02, concurrency=3, at=1100.0))
    data = telemetry.dashboard_data(now=1101.0)["speedup"]
    assert data["edges"] == [1, 4, 16] and data["loads"] == [{"load": "2-4", "max": 4}]
