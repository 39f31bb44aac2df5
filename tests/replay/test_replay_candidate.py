"""Replaying a candidate policy on recorded traffic (replay/candidate.py, the ops view), with no
model: a synthetic recording (records as the gateway writes them: no draft match flags, a header without
pairs) and test_replay_cli's hand-made cost model. ``recorded()``: the growing current file and its rotated
ones; ``replay_candidate()``: the default policy in force beside a candidate, its ``draft_model`` pool left
out and named; ``specgate policy explain --replay``; ``tracing.costs`` in ``specgate policy check``."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli import main
from replay.candidate import MAX_REQUESTS, ReplayTimeout, recorded, replay_candidate
from policies.costmodel import write_cost_model
from policies.load import load_policy, load_policy_file
from policies.trace import Trace, TraceError, encode_line, read_trace, write_trace
from tests.replay.candidate_helpers import DEFAULT, LEFT_OUT, NGRAM_K4, OTHER, REVISION, header, traffic
from tests.replay.replay_helpers import CODE_RATIO, PROSE_RATIO, costs


def ids(trace: Trace) -> list[str]:
    return [r.id for r in trace.requests]


# -- recorded(): the current file (growing) and the rotated ones ------------------------------------------------


def test_a_record_being_written_is_left_out_of_the_current_file(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, header(), traffic(3))
    partial = encode_line(traffic(1, first=3)[0])
    with path.open("ab") as f:
        f.write(partial[: len(partial) // 2])  # the recorder is mid-line
    assert ids(recorded(path, keep=4, last=10)) == ["r0", "r1", "r2"]
    with pytest.raises(TraceError, match=r":5: truncated: the last line has no newline"):
        read_trace(path)  # read as a finished trace, the same file is refused

    with path.open("ab") as f:
        f.write(partial[len(partial) // 2:])  # the line is complete: the record is in
    assert ids(recorded(path, keep=4, last=10)) == ["r0", "r1", "r2", "r3"]


@pytest.fixture
def rotated(tmp_path) -> Path:
    """t.jsonl.2 (oldest): r0 r1; t.jsonl.1: r2 r3; t.jsonl (current): r4 r5."""
    path = tmp_path / "t.jsonl"
    for name, first in (("t.jsonl.2", 0), ("t.jsonl.1", 2), ("t.jsonl", 4)):
        write_trace(tmp_path / name, header(), traffic(2, first))
    return path


@pytest.mark.parametrize(("keep", "last", "expected"), [
    (4, 1, ["r5"]),
    (4, 2, ["r4", "r5"]),  # the current file holds enough: no rotated file is read
    (4, 3, ["r3", "r4", "r5"]),
    (4, 5, ["r1", "r2", "r3", "r4", "r5"]),
    (4, 100, ["r0", "r1", "r2", "r3", "r4", "r5"]),  # t.jsonl.3 does not exist: the walk ends there
    (1, 100, ["r2", "r3", "r4", "r5"]),  # only t.jsonl.1 is kept
    (0, 100, ["r4", "r5"]),
])
def test_rotated_files_come_before_the_current_one_newest_last(rotated, keep, last, expected):
    trace = recorded(rotated, keep=keep, last=last)
    assert ids(trace) == expected
    assert trace.header == header()


def test_a_rotated_file_of_another_revision_ends_the_walk(rotated):
    write_trace(rotated.with_name("t.jsonl.1"), header(OTHER), traffic(2, 2))
    # t.jsonl.2 is of this revision again, but older than the switch: not read either
    assert ids(recorded(rotated, keep=4, last=100)) == ["r4", "r5"]


def test_a_current_file_holding_only_its_header_reads_the_rotated_ones(rotated):
    write_trace(rotated, header(), [])  # just rotated: the header is written before the first record
    assert ids(recorded(rotated, keep=4, last=3)) == ["r1", "r2", "r3"]


def test_no_recording_yet(tmp_path):
    path = tmp_path / "t.jsonl"
    with pytest.raises(TraceError) as caught:
        recorded(path, keep=4, last=10)
    assert str(caught.value) == f"{path}: no recording yet (nothing was recorded since tracing was turned on)"


# -- replay_candidate(): the policy in force, the candidate and plain on the same requests -----------------------


def table(markdown: str, title: str) -> str:
    return markdown.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def ratio_rows(section: str) -> dict[str, str]:
    """"a / b" -> the ratio cell of the section's paired-ratio table."""
    rows = section.split("| TPOT ratio (paired, geomean) |", 1)[1].splitlines()[2:]
    return {row.split(" | ")[0].removeprefix("| "): row.split(" | ")[1] for row in rows if row.startswith("| ")}


def test_the_candidate_beside_the_default_policy_without_its_draft_model_pool(tmp_path):
    policies = {"in force": load_policy_file(DEFAULT), "candidate": load_policy_file(NGRAM_K4)}
    assert policies["in force"].pools["draft"].proposer == "draft_model"  # so does the candidate's
    result = replay_candidate(Trace(header(), traffic(4)), policies, costs(REVISION), seeds=2, source="t.jsonl")

    assert (result.excluded, result.requests) == (["draft"], 4)
    assert result.markdown.startswith("# specgate replay: t.jsonl\n")
    assert result.markdown.endswith(LEFT_OUT)
    assert [line.removeprefix("## ") for line in result.markdown.splitlines() if line.startswith("## ")] == [
        "trace / code", "trace / prose", "trace / all"]
    for title in ("trace / code", "trace / prose", "trace / all"):
        rows = ratio_rows(table(result.markdown, title))
        assert list(rows) == ["in force / plain", "candidate / plain", "candidate / in force"], title
    # the candidate serves every request with n-gram k = 4, alone on the worker: test_replay_cli's ratios
    assert ratio_rows(table(result.markdown, "trace / code"))["candidate / plain"] == f"{CODE_RATIO:.3f}"
    assert ratio_rows(table(result.markdown, "trace / prose"))["candidate / plain"] == f"{PROSE_RATIO:.3f}"

    cells = result.summary["cells"]
    assert sorted(cells) == ["candidate|trace", "in force|trace", "plain|trace"]
    assert all(list(cell) == ["all"] for cell in cells.values())  # the answer keeps only the whole-traffic cells
    assert cells["candidate|trace"]["all"]["choices"] == {"ngram-k4": 8}  # 4 requests, 2 seeds
    in_force = cells["in force|trace"]["all"]["choices"]
    assert sum(in_force.values()) == 8 and not any(label.startswith("draft") for label in in_force)
    ratios = {(r["a"], r["b"], r["slice"]): r["ratio"] for r in result.summary["ratios"]}
    assert ratios[("candidate", "plain", "code")] == pytest.approx(CODE_RATIO, rel=1e-9)
    assert ratios[("candidate", "plain", "prose")] == pytest.approx(PROSE_RATIO, rel=1e-9)


def test_policies_without_a_draft_model_pool_leave_nothing_out():
    plain_only = load_policy("""version: 1
slices: [{name: prose}]
pools: {plain: {proposer: none, workers: ["http://w:1"]}}
rules: [{name: plain, then: bypass}]
""", "plain.yaml")
    result = replay_candidate(Trace(header(), traffic(2)), {"in force": plain_only, "candidate": plain_only},
                              costs(REVISION), seeds=1)
    assert result.excluded == [] and "Left out" not in result.markdown
    assert ratio_rows(table(result.markdown, "trace / all")) == {
        "in force / plain": "1.000", "candidate / plain": "1.000", "candidate / in force": "1.000"}


def test_bounds_on_requests_and_time():
    policies = {"in force": load_policy_file(DEFAULT), "candidate": load_policy_file(NGRAM_K4)}
    too_many = Trace(header(), traffic(1) * (MAX_REQUESTS + 1))  # only the count is looked at
    with pytest.raises(ValueError) as caught:
        replay_candidate(too_many, policies, costs(REVISION))
    assert str(caught.value) == f"last: at most {MAX_REQUESTS} requests per replay; ask for fewer"

    with pytest.raises(ValueError) as caught:
        replay_candidate(Trace(header(), []), policies, costs(REVISION))
    assert str(caught.value) == "no recorded request with output tokens to replay"

    with pytest.raises(ReplayTimeout) as caught:  # checked after each run: the first one is past 0 s
        replay_candidate(Trace(header(), traffic(2)), policies, costs(REVISION), seeds=2, deadline_s=0)
    # plain is the same for both seeds (fixed, greedy, recorded times): 1 run, and 2 for each policy
    assert str(caught.value) == ("the replay passed its 0 s bound after 1 of 5 runs; ask for fewer requests, seeds "
                                 "or loads")


# -- specgate policy explain FILE --replay TRACE --costs COSTS --against IN_FORCE ------------------------------


@pytest.fixture
def recording(tmp_path):
    trace, cost_file, candidate = tmp_path / "t.jsonl", tmp_path / "costs.json", tmp_path / "candidate.yaml"
    write_trace(trace, header(), traffic(4))
    with trace.open("ab") as f:
        f.write(encode_line(traffic(1, first=4)[0])[:40])  # a record being written
    write_cost_model(cost_file, costs(REVISION))
    candidate.write_text(NGRAM_K4.read_text())
    return trace, cost_file, candidate


def explain(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["policy", "explain", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_replays_the_candidate_against_the_policy_in_force(recording, capsys):
    trace, cost_file, candidate = recording
    code, out, err = explain(capsys, candidate, "--replay", trace, "--costs", cost_file, "--against", DEFAULT,
                             "--seeds", "1")
    assert (code, err) == (0, "")
    assert out.startswith(f"# specgate replay: {trace}\n\n4 requests (0 sampled")  # the partial 5th left out
    rows = ratio_rows(table(out, "trace / code"))
    assert list(rows) == ["default (in force) / plain", "candidate / plain", "candidate / default (in force)"]
    assert rows["candidate / plain"] == f"{CODE_RATIO:.3f}"
    assert out.endswith(LEFT_OUT + "\n")

    code, out, err = explain(capsys, candidate, "--replay", trace, "--costs", cost_file, "--seeds", "1",
                             "--last", "1")
    assert (code, err) == (0, "")  # without --against: the candidate and plain, on r3 alone (prose)
    assert out.startswith(f"# specgate replay: {trace}\n\n1 requests (0 sampled")
    assert ratio_rows(table(out, "trace / prose")) == {"candidate / plain": f"{PROSE_RATIO:.3f}"}


def test_explain_replay_needs_a_cost_model(recording, capsys):
    trace, _, candidate = recording
    assert explain(capsys, candidate, "--replay", trace, "--against", DEFAULT) == (
        2, "", "error: --replay needs --costs FILE or URL (a cost model: specgate trace calibrate --out FILE; or a "
        "running worker's live step costs: --costs http://HOST:PORT)\n")


def test_explain_replay_refuses_a_bad_load_as_a_usage_error(recording, capsys):
    trace, cost_file, candidate = recording
    code, out, err = explain(capsys, candidate, "--replay", trace, "--costs", cost_file, "--loads", "trace", "x9")
    assert (code, out) == (2, "")
    assert err.startswith("error: --loads: 'x9' is not a load; use cN")


def test_explain_replay_refuses_an_invalid_candidate_with_policy_checks_errors(recording, capsys):
    trace, cost_file, candidate = recording
    candidate.write_text(candidate.read_text().replace("then: {pool: ngram, draft_tokens: 4}",
                                                       "then: {pool: ngramm, draft_tokens: 4}"))
    code, out, err = explain(capsys, candidate, "--replay", trace, "--costs", cost_file, "--against", DEFAULT)
    assert (code, out) == (1, "")
    lines = err.splitlines()
    assert len(lines) == 2 and "unknown pool 'ngramm'" in lines[0]
    assert lines[1] == f"{candidate}: invalid policy (1 error(s))"


def test_explain_replay_names_a_missing_recording(recording, capsys, tmp_path):
    _, cost_file, candidate = recording
    missing = tmp_path / "none.jsonl"
    assert explain(capsys, candidate, "--replay", missing, "--costs", cost_file) == (
        1, "", f"error: {missing}: no recording yet (nothing was recorded since tracing was turned on)\n")


# -- tracing.costs: relative to the policy's folder, and must exist ---------------------------------------------

TRACED = DEFAULT.read_text() + "tracing: {path: traces/t.jsonl, costs: costs.json}\n"


def test_policy_check_refuses_a_missing_cost_model_and_names_the_fix(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(TRACED)
    (tmp_path / "traces").mkdir()
    assert load_policy_file(path).tracing.costs == "costs.json"
    assert main(["policy", "check", str(path)]) == 1
    assert capsys.readouterr().err == (f"{path}: tracing.costs {tmp_path}/costs.json: no such file; write one with "
                                       "specgate trace calibrate --out FILE, or remove the key\n")
    write_cost_model(tmp_path / "costs.json", costs(REVISION))
    assert main(["policy", "check", str(path)]) == 0
    assert capsys.readouterr().err == ""
