"""Pair gates in telemetry: exact series after a scripted ``GateBook`` (tests/telemetry/gate_script.py), one
``pair_gate`` log line per event, stale pools' series removed, labels bounded, and the dashboard's rows."""

from __future__ import annotations

import io
import json

import pytest

from gateway.telemetry_views import gate_event_view, gate_views
from telemetry import Telemetry
from telemetry.logs import configure_logging
from telemetry.views import GateRegionView, GateView
from tests.telemetry.exposition import lab, only, samples
from tests.telemetry.gate_script import KEYS, script, start

NOW, WALL = 100.0, 1_700_000_000.0  # the script's monotonic and wall clocks; it runs 30 s
STATES = ("pending", "passed", "failed", "degraded")


def _fed(policy, at: float = NOW + 40) -> Telemetry:
    """Telemetry after the script's events and its book's views at ``at``, as the gateway hands them over."""
    telemetry = Telemetry(policy)
    book, events = script(NOW, WALL)
    telemetry.record_gate_events([gate_event_view(e) for e in events])
    telemetry.set_gates(gate_views(book, at))
    return telemetry


def _states(found) -> dict[str, str]:
    """pool -> the one state its Enum marks (and every state of it exported, 0 or 1)."""
    marked = {}
    for labels, value in only(found, "specgate_pair_gate_state").items():
        d = dict(labels)
        assert value in (0, 1)
        if value == 1:
            assert d["pool"] not in marked, f"{d['pool']} has two states"
            marked[d["pool"]] = d["specgate_pair_gate_state"]
    return marked


@pytest.mark.usefixtures("quiet_logs")
def test_gate_series_after_the_script_are_exact(policy):
    found = samples(_fed(policy))
    assert only(found, "specgate_pair_gate_transitions_total") == {
        lab(pool="ngram", gate="version", state="pending"): 1, lab(pool="draft", gate="version", state="pending"): 1,
        lab(pool="ngram", gate="equivalence", state="passed"): 1,
        lab(pool="draft", gate="equivalence", state="failed"): 1,
        # the closed region (prose at bucket 0) is an event that keeps the state
        lab(pool="ngram", gate="serving", state="passed"): 1,
        lab(pool="ngram", gate="collapse", state="degraded"): 1}
    assert only(found, "specgate_pair_collapse_alerts_total") == {lab(pool="ngram"): 1, lab(pool="draft"): 0}
    assert _states(found) == {"ngram": "degraded", "draft": "failed"}
    assert len(only(found, "specgate_pair_gate_state")) == 2 * len(STATES)
    assert only(found, "specgate_pair_gate_ramp_share") == {lab(pool="ngram", slice="code", bucket="2"): 0.5,
                                                            lab(pool="ngram", slice="prose", bucket="0"): 0.0}
    lines = _fed(policy).metrics_response()[0].decode().splitlines()
    for line in ('specgate_pair_gate_state{pool="ngram",specgate_pair_gate_state="degraded"} 1.0',
                 'specgate_pair_gate_state{pool="ngram",specgate_pair_gate_state="passed"} 0.0',
                 'specgate_pair_gate_ramp_share{bucket="2",pool="ngram",slice="code"} 0.5',
                 'specgate_pair_collapse_alerts_total{pool="draft"} 0.0',
                 'specgate_pair_gate_transitions_total{gate="collapse",pool="ngram",state="degraded"} 1.0'):
        assert line in lines, line


@pytest.mark.usefixtures("quiet_logs")
def test_pending_pools_export_their_state_and_a_zero_collapse_count(policy):
    telemetry = Telemetry(policy)
    book = start(NOW, WALL)
    telemetry.record_gate_events([gate_event_view(e) for e in book.drain()])
    telemetry.set_gates(gate_views(book, NOW))
    found = samples(telemetry)
    assert _states(found) == {"ngram": "pending", "draft": "pending"}
    # exported before the first collapse: increase() over the alert's window sees 0 -> 1
    assert only(found, "specgate_pair_collapse_alerts_total") == {lab(pool="ngram"): 0, lab(pool="draft"): 0}
    assert only(found, "specgate_pair_gate_ramp_share") == {}
    assert only(found, "specgate_pair_gate_transitions_total") == {
        lab(pool="ngram", gate="version", state="pending"): 1, lab(pool="draft", gate="version", state="pending"): 1}


@pytest.mark.usefixtures("quiet_logs")
def test_a_pool_gone_from_the_views_loses_its_state_and_ramp_series(policy):
    telemetry = Telemetry(policy)
    book, events = script(NOW, WALL)
    telemetry.record_gate_events([gate_event_view(e) for e in events])
    telemetry.set_gates(gate_views(book, NOW + 40))
    book.sync({"draft": KEYS["draft"]}, NOW + 50, WALL + 50)  # a reload dropped ngram's pair
    telemetry.set_gates(gate_views(book, NOW + 50))
    found = samples(telemetry)
    assert _states(found) == {"draft": "failed"}
    assert {dict(k)["pool"] for k in only(found, "specgate_pair_gate_state")} == {"draft"}
    assert only(found, "specgate_pair_gate_ramp_share") == {}
    # counters are not taken back: what happened stays counted
    assert only(found, "specgate_pair_collapse_alerts_total") == {lab(pool="ngram"): 1, lab(pool="draft"): 0}
    assert [row["pool"] for row in telemetry.dashboard_data()["gates"]] == ["draft"]


@pytest.mark.usefixtures("quiet_logs")
def test_gate_labels_are_bounded_by_the_policy(policy):
    telemetry = Telemetry(policy)
    region = dict(share=0.25, closed_for_s=None, steps=0, last="")
    telemetry.set_gates({"rogue": GateView(
        pool="rogue", state="passed", key="k", reason="r", since=WALL, running=False, collapses=0, verdict=None,
        regions=(GateRegionView(slice="haiku", bucket=8, **region), GateRegionView(slice="code", bucket=7, **region),
                 GateRegionView(slice="code", bucket=9, **region)))})
    found = samples(telemetry)
    assert _states(found) == {"other": "passed"}
    # buckets 0-7: one per edge of the default 1, 2, 4, ..., 64 and one above 64
    assert only(found, "specgate_pair_gate_ramp_share") == {
        lab(pool="other", slice="other", bucket="other"): 0.25, lab(pool="other", slice="code", bucket="7"): 0.25,
        lab(pool="other", slice="code", bucket="other"): 0.25}


def test_one_log_line_per_gate_event_with_its_fields(policy):
    stream = io.StringIO()
    configure_logging(json=True, stream=stream)
    _fed(policy)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    fields = ("level", "pool", "key", "gate", "state", "previous", "reason")
    assert [tuple(line[f] for f in fields) for line in lines if line["event"] == "pair_gate"] == [
        ("info", "ngram", KEYS["ngram"], "version", "pending", None, "pair version first seen"),
        ("info", "draft", KEYS["draft"], "version", "pending", None, "pair version first seen"),
        ("info", "ngram", KEYS["ngram"], "equivalence", "passed", "pending",
         "8 canaries identical to plain over 256 tokens; sampled check p = 0.41"),
        ("warning", "draft", KEYS["draft"], "equivalence", "failed", "pending",
         "canary code-1 differs from plain at output position 3"),
        ("info", "ngram", KEYS["ngram"], "serving", "passed", "passed",
         "slice prose, load bucket 0 closed for 600 s: p50 TPOT 1.50x plain > 1"),
        ("warning", "ngram", KEYS["ngram"], "collapse", "degraded", "passed",
         "slice prose: accept length 1.00 per round < floor 1.05 (baseline 2.60)")]
    assert len(lines) == 6, "set_gates logs nothing"


@pytest.mark.usefixtures("quiet_logs")
def test_dashboard_rows_carry_state_verdict_regions_with_their_loads_and_history(policy):
    rows = {row["pool"]: row for row in _fed(policy).dashboard_data()["gates"]}
    assert list(rows) == ["draft", "ngram"]
    ngram, draft = rows["ngram"], rows["draft"]
    assert (ngram["state"], ngram["since"], ngram["collapses"], ngram["running"]) == ("degraded", WALL + 30, 1, False)
    assert [(r["slice"], r["bucket"], r["load"], r["share"], r["closed_for_s"], r["steps"]) for r in ngram["regions"]] \
        == [("code", 2, "3-4", 0.5, None, 1), ("prose", 0, "1", 0.0, 580.0, 1)]
    assert ngram["regions"][0]["last"] == "share -> 0.50 (TPOT 0.50x plain, TTFT 1.00x plain, SLO 1.00 vs 1.00)"
    assert [(e["gate"], e["state"]) for e in ngram["history"]] == [
        ("version", "pending"), ("equivalence", "passed"), ("serving", "passed"), ("collapse", "degraded")]
    assert draft["verdict"] == {
        "passed": False, "error": False, "reason": "canary code-1 differs from plain at output position 3",
        "canaries": 3, "tokens": 70, "accept_length": 2.1, "sampled_p": None, "seconds": 4.0,
        "mismatch": "canary code-1, output position 3: speculative token 42, plain token 17",
        "worker": "http://127.0.0.1:30003"}
