"""`specgate replay` (cli/replay.py) in-process on a synthetic trace and a hand-made cost model: the
tables and paired ratios it prints (the ratios computed by hand), what --out writes, and the exact error
and exit code for each kind of bad input, with nothing written."""

from __future__ import annotations

import json
import math
import re

import pytest

from cli import main
from policies.costmodel import write_cost_model
from policies.errors import PolicyError
from policies.load import load_policy_file
from tests.replay.replay_helpers import (BYPASS, CODE_NGRAM_TPOT, CODE_RATIO, OTHER, PINNED, PLAIN_TPOT,
                                          PROSE_NGRAM_TPOT, PROSE_RATIO, REVISION, costs)


def replay(capsys, trace, cost_file, *args: str) -> tuple[int, str, str]:
    code = main(["replay", "--trace", str(trace), "--costs", str(cost_file), "--processes", "1", *args])
    out, err = capsys.readouterr()
    return code, out, err


def sections(markdown: str) -> dict[str, str]:
    parts = markdown.split("\n## ")[1:]
    return {part.split("\n", 1)[0]: part for part in parts}


def test_tables_per_load_and_slice_and_the_paired_ratios(replay_files, capsys):
    code, out, err = replay(capsys, *replay_files, "--arms", "plain", "ngram-k4", "--loads", "c1", "c2", "--seeds", "2",
                            "--mix", "by-slice")
    assert code == 0, err
    assert out.startswith(f"# specgate replay: {replay_files[0]}\n")
    tables = sections(out)
    assert list(tables) == [f"{load} / {slice_}" for load in ("c1", "c2") for slice_ in ("code", "prose", "all")]
    for name, table in tables.items():
        rows = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ")]
        assert rows == ["| contender", "| plain", "| ngram-k4", "| TPOT ratio (paired, geomean)",
                        "| ngram-k4 / plain"], name
    assert CODE_RATIO < 0.3 and PROSE_RATIO > 1  # copying pays, proposing in vain costs its calls
    for slice_, expected in (("code", CODE_RATIO), ("prose", PROSE_RATIO),
                             ("all", math.sqrt(CODE_RATIO * PROSE_RATIO))):
        assert f"\n| ngram-k4 / plain | {expected:.3f} | " in tables[f"c1 / {slice_}"], slice_
    c2_code = [line for line in tables["c2 / code"].splitlines() if line.startswith("| ngram-k4 / plain |")]
    assert len(c2_code) == 1 and float(c2_code[0].split(" | ")[1]) < 1
    # fixed arms, closed loop, by-slice, all greedy: one simulation per (arm, load) stands for both seeds
    assert "replay runs: 4/4 (100%), " in err and re.search(r"\nreplay: 8 runs in [0-9.]+ s\n$", err)


def test_out_writes_markdown_json_and_plots(replay_files, capsys, tmp_path):
    out_dir = tmp_path / "report"
    code, out, err = replay(capsys, *replay_files, "--arms", "plain", "ngram-k4", "--loads", "c1", "c2", "--seeds", "2",
                            "--mix", "by-slice", "--out", str(out_dir))
    assert code == 0, err
    assert sorted(p.name for p in out_dir.iterdir()) == ["replay-goodput.png", "replay-tpot.png", "replay.json",
                                                          "replay.md"]
    assert (out_dir / "replay.md").read_text() + "\n" == out
    assert out.endswith("![replay-tpot](replay-tpot.png)\n![replay-goodput](replay-goodput.png)\n\n")
    for png in ("replay-tpot.png", "replay-goodput.png"):
        assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out_dir}/replay.md, replay.json and 2 plots" in err

    report = json.loads((out_dir / "replay.json").read_text())
    assert sorted(report["cells"]) == ["ngram-k4|c1", "ngram-k4|c2", "plain|c1", "plain|c2"]
    assert all(sorted(cell) == ["all", "code", "prose"] for cell in report["cells"].values())
    plain, ngram = report["cells"]["plain|c1"], report["cells"]["ngram-k4|c1"]
    assert plain["code"]["tpot_ms"]["p50"] == pytest.approx(PLAIN_TPOT * 1e3, abs=0.005)
    assert ngram["code"]["tpot_ms"]["p50"] == pytest.approx(CODE_NGRAM_TPOT * 1e3, abs=0.005)
    assert ngram["prose"]["tpot_ms"]["p50"] == pytest.approx(PROSE_NGRAM_TPOT * 1e3, abs=0.005)
    assert (ngram["code"]["accept_length"], ngram["prose"]["accept_length"]) == (4.0, 1.0)  # 12 tokens, 3 and 12 rounds
    assert (ngram["all"]["requests"], ngram["all"]["seeds"], ngram["all"]["choices"]) == (4, 2, {"ngram-k4": 8})
    ratios = {(r["load"], r["slice"]): r for r in report["ratios"]}
    assert {(r["a"], r["b"]) for r in report["ratios"]} == {("ngram-k4", "plain")}
    assert ratios[("c1", "code")]["ratio"] == pytest.approx(CODE_RATIO, rel=1e-9)
    assert ratios[("c1", "prose")]["ratio"] == pytest.approx(PROSE_RATIO, rel=1e-9)
    assert ratios[("c1", "all")]["ratio"] == pytest.approx(math.sqrt(CODE_RATIO * PROSE_RATIO), rel=1e-9)
    # a fixed arm at c1 in by-slice order is the same for every seed: its interval is over requests
    assert (ratios[("c1", "code")]["over"], ratios[("c1", "code")]["pairs"]) == ("requests", 2)
    assert report["meta"]["slo_ms"] == [2000.0, 150.0] and report["settings"]["loads"] == ["c1", "c2"]


def test_default_arms_are_those_the_trace_can_replay(replay_files, capsys, tmp_path):
    out_dir = tmp_path / "report"
    code, _, err = replay(capsys, *replay_files, "--loads", "c1", "--seeds", "1", "--out", str(out_dir))
    assert code == 0, err
    report = json.loads((out_dir / "replay.json").read_text())
    # no self-draft pair in the trace: the draft arms are left out
    assert list(report["cells"]) == ["plain|c1", "ngram-k2|c1", "ngram-k4|c1", "ngram-k8|c1", "suffix-k8|c1"]


def test_policies_against_arms_and_the_first_policy_sets_the_slo(replay_files, capsys, tmp_path):
    pinned, bypass = tmp_path / "pinned.yaml", tmp_path / "bypass.yaml"
    pinned.write_text(PINNED)
    bypass.write_text(BYPASS)
    out_dir = tmp_path / "report"
    code, out, err = replay(capsys, *replay_files, "--policy", str(pinned), "--policy", str(bypass), "--arms", "plain",
                            "ngram-k4", "--loads", "c1", "--seeds", "2", "--mix", "by-slice", "--out", str(out_dir))
    assert code == 0, err
    report = json.loads((out_dir / "replay.json").read_text())
    assert report["meta"]["slo_ms"] == [900.0, 40.0]  # pinned.yaml's, the first --policy
    assert report["cells"]["pinned|c1"]["all"]["choices"] == {"ngram-k4": 4, "plain": 4}  # 2 seeds
    ratios = {(r["a"], r["b"], r["slice"]): r["ratio"] for r in report["ratios"]}
    expected = {("pinned", "plain", "code"): CODE_RATIO, ("pinned", "plain", "prose"): 1.0,
                ("pinned", "ngram-k4", "code"): 1.0, ("pinned", "ngram-k4", "prose"): 1 / PROSE_RATIO,
                ("bypass", "plain", "code"): 1.0, ("bypass", "pinned", "code"): 1 / CODE_RATIO,
                ("bypass", "ngram-k4", "prose"): 1 / PROSE_RATIO, ("ngram-k4", "plain", "code"): CODE_RATIO}
    for key, ratio in expected.items():
        assert ratios[key] == pytest.approx(ratio, rel=1e-9), key
    assert {(a, b) for a, b, _ in ratios} == {
        ("ngram-k4", "plain"), ("pinned", "plain"), ("bypass", "plain"), ("pinned", "ngram-k4"),
        ("bypass", "ngram-k4"), ("bypass", "pinned")}
    assert "\n| pinned / ngram-k4 | 1.000 | " in sections(out)["c1 / code"]


# -- bad input: exit 1 (2 for usage) with one message naming the problem, and nothing written -----------------


def refused(capsys, tmp_path, trace, cost_file, *args: str, code: int = 1) -> str:
    out_dir = tmp_path / "report"
    returned, out, err = replay(capsys, trace, cost_file, "--seeds", "1", "--out", str(out_dir), "--loads", "c1",
                                *args)
    assert (returned, out) == (code, "")
    assert not out_dir.exists()
    return err


def test_a_truncated_trace(replay_files, capsys, tmp_path):
    trace, cost_file = replay_files
    trace.write_bytes(trace.read_bytes()[:-1])  # the writer stopped before the last newline
    assert refused(capsys, tmp_path, trace, cost_file, "--arms", "plain") == (
        f"error: {trace}:5: truncated: the last line has no newline (the writer stopped mid-line); rebuild the "
        "trace or drop that line\n")


def test_a_prefill_chunk_beyond_the_calibrated_grid_is_refused(replay_files, capsys, tmp_path):
    """A chunk asked for past the grid's largest would be priced by extrapolation: refused, naming the fix. At
    the grid's edge it replays. (Not asked for, the worker's default 256 is replayed whatever the grid: a
    worker's live step costs carry no prefill grid of their own.)"""
    trace, cost_file = replay_files
    assert refused(capsys, tmp_path, trace, cost_file, "--arms", "plain", "--prefill-chunk", "258", code=2) == (
        "error: --prefill-chunk 258: the cost model's prefill grid ends at 257 tokens, and a chunk beyond it would "
        "be priced by extrapolation, which no measurement backs; calibrate with `specgate trace calibrate "
        "--prefill-tokens 16 64 256 258` and replay with that file, or replay with --prefill-chunk 257\n")
    assert replay(capsys, trace, cost_file, "--seeds", "1", "--loads", "c1", "--arms", "plain",
                  "--prefill-chunk", "257")[0] == 0
    assert refused(capsys, tmp_path, trace, cost_file, "--arms", "plain", "--prefill-chunk", "0", code=2) == (
        "error: --seeds, --max-running-requests, --prefill-chunk and --max-batch-tokens must be at least 1\n")


def test_a_cost_model_of_another_revision(replay_files, capsys, tmp_path):
    trace, cost_file = replay_files
    write_cost_model(cost_file, costs(OTHER))
    assert refused(capsys, tmp_path, trace, cost_file, "--arms", "plain") == (
        f"error: {cost_file}: field revision: the cost model was calibrated for model revision {OTHER}, this "
        f"model is {REVISION}; recalibrate (specgate trace calibrate) on this model\n")


def test_an_invalid_policy_is_refused_with_policy_checks_errors(replay_files, capsys, tmp_path):
    policy = tmp_path / "bad.yaml"
    policy.write_text(PINNED.replace("then: {pool: ngram, draft_tokens: 4}", "then: {pool: ngramm, draft_tokens: 4}"))
    with pytest.raises(PolicyError) as caught:
        load_policy_file(policy)
    errors = caught.value.errors
    assert len(errors) == 1 and "unknown pool 'ngramm'" in errors[0]
    assert main(["policy", "check", str(policy)]) == 1
    assert capsys.readouterr().err.splitlines()[:-1] == errors  # what `specgate policy check` prints
    assert refused(capsys, tmp_path, *replay_files, "--policy", str(policy), "--arms", "plain") == (
        f"error: --policy {policy}: invalid policy (specgate policy check {policy}):\n{errors[0]}\n")


def test_a_policy_for_another_model_revision(replay_files, capsys, tmp_path):
    policy = tmp_path / "other.yaml"
    policy.write_text(PINNED.replace(REVISION, OTHER))
    assert refused(capsys, tmp_path, *replay_files, "--policy", str(policy), "--arms", "plain") == (
        f"error: --policy {policy}: pair p targets revision {OTHER}, but the trace was recorded on {REVISION}; "
        "replay a trace of that model\n")


@pytest.mark.parametrize("arm", ["medusa-k4", "ngram-k17", "ngram-k0", "ngram"])
def test_an_unknown_arm(replay_files, capsys, tmp_path, arm):
    assert refused(capsys, tmp_path, *replay_files, "--arms", "plain", arm) == (
        f"error: --arms: {arm!r} is not an arm; use plain, ngram-kN, suffix-kN, hybrid-kN, draft-kN or draftL-kN (L "
        "layers of the self-draft), N in 1..16, optionally with a per-round controller: -beta, -sglang, -vllm=TABLE "
        "(e.g. ngram-k8-vllm=1:8,4:4,16:2), or a reference: -oracle or -informed[=FEATURES] (n-gram only, e.g. "
        "ngram-k16-informed=request+match; hybrid-k16-oracle)\n")


def test_a_draft_arm_needs_the_pair_in_the_trace(replay_files, capsys, tmp_path):
    assert refused(capsys, tmp_path, *replay_files, "--arms", "plain", "draft-k4") == (
        "error: --arms draft-k4: the trace carries 0 matching self-draft pairs (it has: none); name the layers "
        "(draft8-k4), or rebuild the trace with --draft-layers N\n")


def test_a_bad_load_is_a_usage_error(replay_files, capsys, tmp_path):
    assert refused(capsys, tmp_path, *replay_files, "--arms", "plain", "--loads", "x9", code=2) == (
        "error: --loads: 'x9' is not a load; use cN (N closed-loop clients, e.g. c4), pR (Poisson arrivals at R "
        "requests/s, e.g. p0.5) or trace (the trace's own arrival times)\n")


def test_the_report_names_the_command_that_made_it(replay_files, capsys, tmp_path, monkeypatch):
    """Its subcommand included (it used to read ``specgate --trace ...``); none when not run from a command line."""
    trace, cost_file = replay_files
    argv = ["replay", "--trace", str(trace), "--costs", str(cost_file), "--arms", "plain", "--loads", "c1",
            "--seeds", "1", "--processes", "1"]
    monkeypatch.setattr("sys.argv", ["/venv/bin/specgate", *argv])
    assert main(argv) == 0
    assert f"Command: `specgate replay --trace {trace} --costs {cost_file} --arms plain --loads c1 --seeds 1 " \
           "--processes 1`" in capsys.readouterr().out
    monkeypatch.setattr("sys.argv", ["pytest"])
    assert main(argv) == 0
    assert "Command: `" not in capsys.readouterr().out
