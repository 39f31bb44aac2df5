"""The pair gates' state machine (gateway/gates/book.py), driven by scripted verdicts and samples with explicit
times: equivalence, the serving ramp per load region, the collapse detector and the outcome gate."""

from __future__ import annotations

import pytest
from scipy import stats as scistats

from gateway.gates.book import GateBook
from gateway.gates.values import Mismatch, Sample, Verdict
from policies.schema import Collapse, Equivalence, Gates, OutcomeCheck, Serving

PASS = Verdict(passed=True, reason="4 canaries token-identical to plain", accept_length=2.0, histogram=(1, 2, 3))
FAIL = Verdict(passed=False, reason="greedy output differs on canary 'c1' at output position 3",
               mismatch=Mismatch(canary="c1", position=3, speculative=7, plain=9))
ERROR = Verdict(passed=False, error=True, reason="a canary request failed: HTTP 500")
SERVING = Serving(initial_share=0.25, growth=2.0, window=4, retry_s=60.0)
COLLAPSE = Collapse(window_rounds=20, recheck_s=300.0)
GATES = Gates(equivalence=Equivalence(retry_s=30.0), serving=SERVING, collapse=COLLAPSE,
              outcome=OutcomeCheck(min_reports=20, ttl_s=100.0, max_tracked=1000))


def passed(gates: Gates = GATES, verdict: Verdict = PASS, at: float = 0.0) -> GateBook:
    """A book whose pool ``eagle`` (key v1) has just passed equivalence; events drained."""
    book = GateBook(gates)
    book.sync({"eagle": "v1"}, at, at)
    book.finished("eagle", book.started("eagle"), verdict, at, at)
    assert book.pools["eagle"].state == "passed"
    book.drain()
    return book


def sample(rid: str = "r", *, pool: str | None = "eagle", slice_: str = "code", bucket: int = 0, route: str = "ide",
           tpot: float | None = 0.05, ttft: float | None = 0.2, slo: bool | None = True, rounds: int = 0,
           correct: int = 0, histogram: tuple[int, ...] = (), tokens: int = 0, seconds: float = 0.0,
           ok: bool = True, resumed: bool = False) -> Sample:
    return Sample(request_id=rid, route=route, slice=slice_, bucket=bucket, pool=pool, ok=ok,
                  key="v1" if pool else "", tpot_s=tpot, ttft_s=ttft, slo_met=slo, verify_ct=rounds,
                  correct_drafts=correct, histogram=histogram, completion_tokens=tokens, seconds=seconds,
                  resumed=resumed)


# -- equivalence ---------------------------------------------------------------------------------------------

def test_new_key_is_pending_then_passes() -> None:
    book = GateBook(GATES)
    book.sync({"eagle": "v1"}, 5.0, 1005.0)
    [event] = book.drain()
    assert (event.pool, event.key, event.gate, event.state, event.previous, event.at) == (
        "eagle", "v1", "version", "pending", None, 1005.0)
    assert book.pool_state("eagle", 5.0) == ("pending", {}, 1.0)
    assert book.due(5.0) == ["eagle"]
    key = book.started("eagle")
    assert key == "v1" and book.due(5.0) == []  # running: not due twice
    book.finished("eagle", key, PASS, 6.0, 1006.0)
    [event] = book.drain()
    assert (event.gate, event.state, event.previous, event.reason) == ("equivalence", "passed", "pending", PASS.reason)
    assert book.due(1e6) == [] and book.pool_state("eagle", 6.0) == ("passed", {}, 0.25)
    view = book.view("eagle", 6.0)
    assert view["verdict"] == PASS and not view["running"] and len(view["history"]) == 2


def test_failing_verdict_fails_with_its_reason() -> None:
    book = GateBook(GATES)
    book.sync({"eagle": "v1"}, 0.0, 0.0)
    book.finished("eagle", book.started("eagle"), FAIL, 1.0, 1.0)
    gate = book.pools["eagle"]
    assert (gate.state, gate.reason, gate.verdict.mismatch.position) == ("failed", FAIL.reason, 3)
    assert [e.state for e in book.drain()] == ["pending", "failed"]
    assert book.due(1e6) == []  # a failed pair is not re-run until its key changes or ops ask


def test_error_verdict_stays_pending_and_retries_after_retry_s() -> None:
    book = GateBook(GATES)
    book.sync({"eagle": "v1"}, 0.0, 0.0)
    book.drain()
    book.finished("eagle", book.started("eagle"), ERROR, 10.0, 10.0)
    gate = book.pools["eagle"]
    assert gate.state == "pending" and not gate.running and book.drain() == []
    assert gate.reason == "equivalence gate could not run: a canary request failed: HTTP 500; retrying"
    assert book.due(39.9) == [] and book.due(40.0) == ["eagle"]


def test_unknown_identity_waits_and_a_removed_pool_is_forgotten() -> None:
    book = GateBook(GATES)
    book.sync({"eagle": None}, 0.0, 0.0)
    assert book.pools["eagle"].key == "" and book.due(0.0) == []  # nothing to run the gate for yet
    book.sync({"eagle": "v1"}, 1.0, 1.0)
    assert book.due(1.0) == ["eagle"] and len(book.drain()) == 1
    book.sync({}, 2.0, 2.0)
    assert book.pools == {} and book.view("eagle", 2.0) is None


def test_key_change_goes_back_to_pending_and_ignores_the_old_run() -> None:
    book = passed()
    book.sync({"eagle": None}, 1.0, 1.0)  # no healthy worker: the key stays
    assert book.pools["eagle"].state == "passed" and book.drain() == []
    book.force_recheck("eagle", 2.0, 2.0)
    book.drain()
    old = book.started("eagle")
    book.sync({"eagle": "v2"}, 3.0, 3.0)  # a worker restarted with other weights during the run
    [event] = book.drain()
    assert (event.key, event.gate, event.state, event.previous) == ("v2", "version", "pending", "pending")
    assert event.reason == "pair version changed (v1 -> v2): the equivalence gate runs again"
    book.finished("eagle", old, PASS, 4.0, 4.0)  # a verdict on v1 says nothing about v2
    assert book.pools["eagle"].state == "pending" and book.drain() == [] and book.due(4.0) == ["eagle"]
    book.finished("eagle", book.started("eagle"), FAIL, 5.0, 5.0)
    book.sync({"eagle": "v3"}, 6.0, 6.0)  # a policy edit of the pair
    history = book.view("eagle", 6.0)["history"]
    assert [(e.key, e.state, e.previous) for e in history] == [
        ("v1", "pending", None), ("v1", "passed", "pending"), ("v1", "pending", "passed"),
        ("v2", "pending", "pending"), ("v2", "failed", "pending"), ("v3", "pending", "failed")]
    assert book.pools["eagle"].first_verdict is None  # v3's baseline comes from its own verdict


def test_force_recheck() -> None:
    book = passed()
    assert book.force_recheck("eagle", 1.0, 1.0) and book.due(1.0) == ["eagle"]
    [event] = book.drain()
    assert (event.gate, event.state, event.previous, event.reason) == (
        "equivalence", "pending", "passed", "re-check requested by an operator")
    book.started("eagle")
    assert not book.force_recheck("eagle", 2.0, 2.0) and not book.force_recheck("nope", 2.0, 2.0)


def test_no_gates_section_is_inert() -> None:
    book = GateBook(None)
    book.sync({"eagle": "v1"}, 0.0, 0.0)
    book.observe(sample(), 0.0, 0.0)
    assert book.pools == {} and book.due(0.0) == [] and book.pool_state("eagle", 0.0) == (None, {}, 1.0)
    assert book.report("r", "ide", 1.0, 0.0, 0.0) == "off"


# -- serving ramp --------------------------------------------------------------------------------------------

def feed(book: GateBook, n: int, at: float, **kw: object) -> None:
    for i in range(n):
        book.observe(sample(f"{kw.get('pool', 'eagle')}-{at}-{i}", **kw), at, at)


def test_region_ramps_doubles_then_opens() -> None:
    book = passed()
    feed(book, 4, 1.0)
    assert book.pool_state("eagle", 1.0) == ("passed", {"code|0": 0.25}, 0.25)
    feed(book, 3, 1.0, pool=None)
    feed(book, 5, 1.0, pool=None, slice_="prose")  # plain on another slice...
    feed(book, 5, 1.0, pool=None, bucket=1)  # ...or another load bucket is no comparison
    feed(book, 2, 1.0, pool=None, ok=False, tpot=None, slo=False)  # nor is a failed request
    assert book.pool_state("eagle", 1.0)[1] == {"code|0": 0.25}
    assert book.view("eagle", 1.0)["regions"][0]["window"] == {"speculative": 4, "plain": 3}
    feed(book, 1, 1.0, pool=None, tpot=0.06)
    assert book.pool_state("eagle", 1.0)[1] == {"code|0": 0.5} and book.drain() == []
    region = book.view("eagle", 1.0)["regions"][0]
    assert (region["steps"], region["window"]) == (1, {"speculative": 0, "plain": 0})
    assert region["last"] == "share -> 0.50 (TPOT 1.00x plain, TTFT 1.00x plain, SLO 1.00 vs 1.00)"
    feed(book, 4, 2.0, pool=None)
    feed(book, 4, 2.0)
    assert book.pool_state("eagle", 2.0)[1] == {"code|0": 1.0}
    [event] = book.drain()
    assert (event.gate, event.state, event.previous) == ("serving", "passed", "passed")
    assert event.reason.startswith("slice code, load bucket 0 open (TPOT 1.00x plain")
    gate = book.pools["eagle"]
    assert (gate.reason, gate.since) == (PASS.reason, 0.0)  # a region's event is not the pool's state
    feed(book, 4, 3.0)
    assert book.view("eagle", 3.0)["regions"][0]["window"] == {"speculative": 0, "plain": 0}  # open: done


def test_a_resumed_answer_is_outcome_evidence_only() -> None:
    """A request continued on another worker (gateway/resume.py) spans two workers and the gap: slow, with draft
    counters of neither alone. It never enters a ramp window or the collapse watch, speculative side or plain,
    and its outcome can still be reported."""
    book = passed()
    feed(book, 4, 1.0, tpot=0.5, rounds=20, correct=0, histogram=(20,), resumed=True)
    feed(book, 4, 1.0, pool=None, tpot=0.5, resumed=True)
    assert book.view("eagle", 1.0)["regions"] == [] and book.drain() == []
    assert book.pools["eagle"].state == "passed"
    assert book.report("eagle-1.0-0", "ide", 1.0, 2.0, 2.0) is None  # its outcome is taken


@pytest.mark.parametrize("bad, miss", [
    ({"tpot": 0.08}, "p50 TPOT 1.60x plain > 1"),
    ({"ttft": 0.4}, "p50 TTFT 2.00x plain > 1.5"),
    ({"slo": False}, "SLO attainment 0.00x plain < 0.97"),
])
def test_region_closes_on_a_missed_bound_then_ramps_again(bad: dict, miss: str) -> None:
    book = passed()
    feed(book, 4, 1.0, slice_="prose")
    feed(book, 4, 1.0, **bad)
    feed(book, 4, 1.0, pool=None)
    assert book.pool_state("eagle", 1.0)[1] == {"code|0": 0.0, "prose|0": 0.25}  # only code closed
    [event] = book.drain()
    assert event.gate == "serving" and event.reason == f"slice code, load bucket 0 closed for 60 s: {miss}"
    assert book.view("eagle", 1.0)["reason"] == PASS.reason
    assert book.pool_state("eagle", 60.9)[1]["code|0"] == 0.0
    assert book.pool_state("eagle", 61.0)[1]["code|0"] == 0.25
    feed(book, 4, 61.0, pool=None)  # plain before the first speculative sample after the pause: not counted
    feed(book, 1, 61.0)
    assert book.view("eagle", 61.0)["regions"][0]["window"] == {"speculative": 1, "plain": 0}
    assert book.pool_state("eagle", 61.0)[1]["code|0"] == 0.25
    feed(book, 3, 62.0)
    feed(book, 4, 62.0, pool=None)
    assert book.pool_state("eagle", 62.0)[1]["code|0"] == 0.5


# -- collapse ------------------------------------------------------------------------------------------------

def rounds(book: GateBook, n: int, at: float, per: int = 10, correct: int = 0, histogram: tuple[int, ...] = (),
           slice_: str = "code") -> None:
    for i in range(n):
        book.observe(sample(f"c-{at}-{i}", slice_=slice_, rounds=per, correct=correct, histogram=histogram,
                            tpot=None, ttft=None, slo=None), at, at)


def test_collapse_below_floor_degrades_then_recovers() -> None:
    book = passed()
    rounds(book, 1, 1.0)
    assert book.pools["eagle"].state == "passed"  # 10 of 20 rounds: no window yet
    rounds(book, 1, 2.0)
    [event] = book.drain()
    assert (event.gate, event.state, event.previous) == ("collapse", "degraded", "passed")
    assert event.reason == "slice code: accept length 1.00 per round < floor 1.05 (baseline 2.00)"
    assert book.view("eagle", 2.0)["collapses"] == 1 and book.pool_state("eagle", 2.0)[0] == "degraded"
    rounds(book, 1, 3.0, correct=10)
    assert book.pools["eagle"].state == "degraded"
    rounds(book, 1, 4.0, correct=10)
    [event] = book.drain()
    assert (event.gate, event.state, event.previous) == ("collapse", "passed", "degraded")
    assert event.reason == "slice code: accept length 2.00 per round over 20 rounds: recovered"


def test_low_baseline_raises_no_alert() -> None:
    book = passed(verdict=Verdict(passed=True, reason="ok", accept_length=1.2))
    rounds(book, 6, 1.0)
    assert book.pools["eagle"].state == "passed" and book.drain() == []


def test_another_slice_does_not_clear_a_collapse() -> None:
    book = passed()
    rounds(book, 2, 1.0, correct=10, slice_="prose")
    rounds(book, 2, 2.0, slice_="code")
    assert book.pools["eagle"].state == "degraded"
    rounds(book, 1, 3.0, correct=10, slice_="prose")  # prose was never the problem
    assert book.pools["eagle"].state == "degraded"
    rounds(book, 2, 4.0, correct=10, slice_="code")
    assert book.pools["eagle"].state == "passed"


BASE_HIST, HALVED, SMALLER = (10, 15, 25), (35, 10, 5), (25, 15, 10)  # mean accepted drafts 1.3, 0.4, 0.7


def test_histogram_shift_down_by_half_degrades() -> None:
    book = passed(Gates(collapse=Collapse(window_rounds=100)))
    rounds(book, 2, 1.0, per=50, correct=65, histogram=BASE_HIST)  # the live baseline
    rounds(book, 2, 2.0, per=50, correct=20, histogram=HALVED)  # accept length 1.40: above the floor
    [event] = book.drain()
    assert (event.gate, event.state) == ("collapse", "degraded")
    assert event.reason.startswith("slice code: accepted drafts per round fell from 1.30 to 0.40 (histogram "
                                   "shift, chi-square p = ")


def test_small_significant_shift_does_not_degrade() -> None:
    p = scistats.chi2_contingency([[50, 30, 20], [20, 30, 50]]).pvalue
    assert p < 0.001  # significant, but accept fell by less than half: ordinary variation between windows
    book = passed(Gates(collapse=Collapse(window_rounds=100)))
    rounds(book, 2, 1.0, per=50, correct=65, histogram=BASE_HIST)
    rounds(book, 4, 2.0, per=50, correct=35, histogram=SMALLER)
    assert book.pools["eagle"].state == "passed"
    book = passed(Gates(collapse=Collapse(window_rounds=100, shift_alpha=None)))
    rounds(book, 2, 1.0, per=50, correct=65, histogram=BASE_HIST)
    rounds(book, 4, 2.0, per=50, correct=20, histogram=HALVED)
    assert book.pools["eagle"].state == "passed"  # the shift rule switched off


def test_degraded_and_unserved_is_rechecked() -> None:
    book = passed()
    rounds(book, 2, 10.0)
    assert book.pools["eagle"].state == "degraded"
    assert book.due(309.9) == [] and book.due(310.0) == ["eagle"]
    book.drain()
    low = Verdict(passed=True, reason="identical", accept_length=1.0)
    book.finished("eagle", book.started("eagle"), low, 310.0, 310.0)
    gate = book.pools["eagle"]
    assert gate.state == "degraded" and book.drain() == []
    assert gate.reason == "re-check: canaries accept 1.00 per round (< floor 1.05; 2.00 when the pair passed)"
    assert book.due(609.9) == [] and book.due(610.0) == ["eagle"]
    book.finished("eagle", book.started("eagle"), PASS, 610.0, 610.0)
    assert [(e.gate, e.state) for e in book.drain()] == [("equivalence", "passed")]


# -- outcomes ------------------------------------------------------------------------------------------------

def test_report_answers() -> None:
    book = passed()
    book.observe(sample("a"), 1.0, 1.0)
    assert book.report("nope", "ide", 1.0, 2.0, 2.0) == "unknown"
    assert book.report("a", "batch", 1.0, 2.0, 2.0) == "unknown"  # another route's request
    assert book.report("a", "ide", 1.0, 2.0, 2.0) is None
    assert book.report("a", "ide", 0.0, 2.0, 2.0) == "reported"
    assert passed(Gates(outcome=None)).report("a", "ide", 1.0, 2.0, 2.0) == "off"


def outcomes(book: GateBook, pool: str | None, scores: list[float], at: float) -> None:
    for i, score in enumerate(scores):
        rid = f"{pool}-{at}-{i}"
        book.observe(sample(rid, pool=pool, tokens=100, seconds=2.0), at, at)
        assert book.report(rid, "ide", score, at, at) is None


def test_clearly_worse_outcomes_fail_the_pair() -> None:
    book = passed()
    outcomes(book, None, [1.0] * 36 + [0.0] * 4, 1.0)
    outcomes(book, "eagle", [1.0, 0.0] * 10, 2.0)
    [event] = book.drain()
    assert (event.gate, event.state, event.previous) == ("outcome", "failed", "passed")
    assert event.reason.startswith("route ide: success 0.500 over 20 reports vs plain 0.900 over 40 (worse by "
                                   "more than 0.02, p = ")
    assert book.pool_state("eagle", 2.0)[0] == "failed"


def test_equal_outcomes_keep_the_pair_and_cost_per_success_is_shown() -> None:
    book = passed()
    outcomes(book, None, [1.0, 1.0, 1.0, 0.0] * 10, 1.0)
    outcomes(book, "eagle", [1.0, 1.0, 1.0, 0.0] * 10, 2.0)
    assert book.pools["eagle"].state == "passed" and book.drain() == []
    view = book.view("eagle", 2.0)["outcomes"]["ide"]
    assert view["speculative"] == view["plain"] == {"reports": 40, "success_rate": 0.75,
                                                    "tokens_per_success": 4000 / 30, "seconds_per_success": 80 / 30}


def test_too_few_reports_hold_nothing() -> None:
    book = passed()
    outcomes(book, None, [1.0] * 40, 1.0)
    outcomes(book, "eagle", [0.0] * 19, 2.0)
    assert book.pools["eagle"].state == "passed"


def test_outcome_ids_expire_after_ttl_and_beyond_max_tracked() -> None:
    book = passed(Gates(outcome=OutcomeCheck(ttl_s=10.0, max_tracked=3)))
    for i, rid in enumerate("abcd"):
        book.observe(sample(rid), float(i), float(i))
    assert book.report("a", "ide", 1.0, 4.0, 4.0) == "unknown"  # the 4th pushed out the oldest
    assert book.report("b", "ide", 1.0, 4.0, 4.0) is None
    assert book.report("c", "ide", 1.0, 12.5, 12.5) == "unknown"  # finished at 2, ttl 10
    assert book.report("d", "ide", 1.0, 12.5, 12.5) is None
    book.observe(sample("e"), 20.0, 20.0)  # evicts b and d: their ids take no second report, nor a first
    assert [book.report(rid, "ide", 1.0, 20.0, 20.0) for rid in "bde"] == ["unknown", "unknown", None]
