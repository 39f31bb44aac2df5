"""bench/replay_exact.py: its verdicts tell the documented stop-token case from a real difference, its flags
are checked before a model loads, and a run on the tiny random engine compares every round and restores
``RequestStats.record``."""

from __future__ import annotations

import pytest

from bench.replay_exact import AFTER_STOP, DIFFER, EQUAL, RoundTap, compare_rounds, main, run, table
from replay.trace_build import RequestLine
from tests.engine.engine_helpers import make_tiny_engine


@pytest.fixture(autouse=True)
def _single_thread_torch():
    """As in the engine tests (tests/engine/conftest.py): one torch thread, robust on a shared machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_only_a_larger_last_count_after_a_stop_is_the_documented_case():
    rounds = [(4, 2), (4, 0), (4, 1)]
    assert compare_rounds(rounds, rounds, stopped=False) == (EQUAL, 3)
    assert compare_rounds([(4, 2), (4, 0), (4, 3)], rounds, stopped=True) == (AFTER_STOP, 2)
    assert compare_rounds([(4, 2), (4, 0), (4, 3)], rounds, stopped=False) == (DIFFER, 2)  # ended by length
    assert compare_rounds([(4, 2), (4, 0), (4, 0)], rounds, stopped=True) == (DIFFER, 2)  # fewer accepted
    assert compare_rounds([(4, 3), (4, 0), (4, 3)], rounds, stopped=True) == (DIFFER, 1)  # not only the last
    assert compare_rounds([(4, 2), (4, 0), (3, 3)], rounds, stopped=True) == (DIFFER, 2)  # drafted differs
    assert compare_rounds([(4, 2), (4, 0)], rounds, stopped=True) == (DIFFER, 2)  # a round missing


@pytest.mark.parametrize(("argv", "message"), [
    (["--per-slice", "0"], "argument --per-slice: must be at least 1, got 0"),  # --workloads has a default
    (["--workloads", "w", "--per-slice", "0"], "argument --per-slice: must be at least 1, got 0"),
    (["--workloads", "w", "--ks", "4", "17"], "argument --ks: k must be in 1..16, got 17"),
    (["--workloads", "w", "--proposers", "suffix"], "argument --proposers: invalid choice: 'suffix'"),
    (["--workloads", "w", "--slices", "poetry"], "argument --slices: invalid choice: 'poetry'"),
    (["--workloads", "w", "--max-new-tokens", "x"], "argument --max-new-tokens: invalid _positive value: 'x'"),
])
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_folder_that_holds_no_workloads_is_named_with_the_fix(tmp_path, capsys):
    assert main(["--workloads", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        f"error: --workloads {tmp_path}: not a workloads directory (no humaneval/HumanEval.jsonl); pass a full copy "
        "of the sets, or leave it out for the sample in workloads/\n")


def test_missing_workloads_fail_before_a_model_loads(tmp_path, capsys):
    assert main(["--workloads", str(tmp_path / "nowhere"), "--per-slice", "1"]) == 1
    assert "error:" in capsys.readouterr().err


LINES = [
    RequestLine(id="copy", slice="code", body={"messages": [
        {"role": "user", "content": "Repeat exactly: one two three one two three one two three"}]}),
    RequestLine(id="tools", slice="tool_call", body={
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 9,
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]}),
]


def test_a_run_on_the_tiny_engine_compares_every_round(real_tokenizer):
    """The tiny random engine (1-layer self-draft; peaked logits, so it repeats itself and ngram drafts
    get accepted): every run's rounds equal replay's and its output the plain one; the table adds up."""
    from backends.engine.types import RequestStats

    original = RequestStats.record
    engine = make_tiny_engine(real_tokenizer)
    seen = []
    details = run(engine, LINES, max_new_tokens=16, ks=(1, 4), progress=lambda n, d, s: seen.append(n))
    assert RequestStats.record is original  # the tap is closed
    assert seen == [0, 1]
    assert [(d["id"], d["slice"]) for d in details] == [("copy", "code"), ("tools", "tool_call")]
    assert [d["output_tokens"] for d in details] == [16, 9]  # the request's own max_tokens is kept
    assert set(details[0]["runs"]) == {"ngram-k1", "ngram-k4", "draft_model-k1", "draft_model-k4"}
    for d in details:
        for name, r in d["runs"].items():
            assert r["identical"] and r["verdict"] == EQUAL, (d["id"], name, r)
            assert len(r["engine"]) == r["rounds_equal"] > 0
    text, total = table(details, ("ngram", "draft_model"), (1, 4))
    assert (total.requests, total.identical, total.after_stop, total.differ) == (8, 8, 0, [])
    assert total.rounds == total.rounds_equal == sum(len(r["engine"]) for d in details for r in d["runs"].values())
    assert total.accepted == total.accepted_replay > 0  # rounds that accepted drafts were compared
    assert total.longest == max(a for d in details for r in d["runs"].values() for _, a in r["engine"])
    assert text.splitlines()[0].startswith("| slice | proposer | k | requests | rounds compared | rounds equal |")
    assert len(text.splitlines()) == 2 + 2 * 2 * 2 + 1  # header, separator, slice x proposer x k, total
    assert text.splitlines()[-1].startswith(f"| **total** |  |  | 8 | {total.rounds} | {total.rounds} | 8 |")


def _detail(rid: str, slice_: str, runs: dict, near_ties: int = 0) -> dict:
    return {"id": rid, "slice": slice_, "draft": {"near_ties": near_ties}, "runs": {
        name: {"engine": engine, "replay": replayed, "identical": verdict != DIFFER,
               "verdict": verdict, "rounds_equal": sum(e == r for e, r in zip(engine, replayed))}
        for name, (engine, replayed, verdict) in runs.items()}}


def test_the_table_shows_the_stop_case_and_differences_apart():
    stopped = [(4, 4), (4, 3)], [(4, 4), (4, 2)], AFTER_STOP
    details = [
        _detail("a", "prose", {"ngram-k4": stopped, "draft_model-k4": ([(4, 1)], [(4, 1)], EQUAL)}, near_ties=2),
        _detail("b", "prose", {"ngram-k4": ([(4, 0)], [(4, 0)], EQUAL),
                               "draft_model-k4": ([(4, 1), (4, 0)], [(4, 0), (4, 0)], DIFFER)}, near_ties=1)]
    text, total = table(details, ("ngram", "draft_model"), (4,))
    assert text.splitlines()[2:] == [
        "| prose | ngram | 4 | 2 | 3 | 2 | 2 | 7 | 4 | 1 (+1 accepted) | - | 0 |",
        "| prose | draft_model | 4 | 2 | 3 | 2 | 1 | 2 | 1 | 0 | 3 | 1: b |",
        "| **total** |  |  | 4 | 6 | 4 | 3 | 9 | 4 | 1 (+1 accepted) | 3 | 1: b |"]
    assert total.differ == ["b"]


def test_the_tap_restores_record_when_a_run_raises():
    from backends.engine.types import RequestStats

    original = RequestStats.record
    with pytest.raises(RuntimeError), RoundTap():
        assert RequestStats.record is not original
        raise RuntimeError
    assert RequestStats.record is original
