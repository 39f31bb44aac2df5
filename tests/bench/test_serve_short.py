"""The serving benchmark end to end, small: real worker and gateways, real workload prompts, three arms
(plain, fixed n-gram k = 4, suffix decoding with a route per cell, each arm on routes of its own), two slices, one request each served twice
(``--repeats 2``), 8 tokens, one load point. Runs in `make test` so the harness cannot rot; the full run is
`specgate bench serve --preset full`."""

from __future__ import annotations

import gzip
import json
import math
import statistics
import subprocess
import sys

import pytest

from bench.serve.arms import parse_arms
from bench.serve.client import Result
from bench.serve.load import LoadPoint
from bench.serve.report import _targets, _verdict, paired_tpot_ratio
from bench.serve.run import turns
from bench.serve.summary import learning_cost, percentile
from bench.workloads import WorkItem

pytestmark = [pytest.mark.integration, pytest.mark.real_model]
CLI = "import sys; from cli import main; sys.exit(main())"
CELL_KEYS = {"requests", "ok", "errors", "wall_s", "ttft_ms", "tpot_ms", "output_tokens", "output_tok_s",
             "slo_met", "slo_attainment", "goodput_rps", "accept_length", "decisions_by_rule", "choices",
             "gateway_slices", "peak_rss_mb", "identical_to_plain", "compared_to_plain", "not_identical"}
SLICES = ["code_edit", "prose"]
ARMS = ["plain", "ngram-k4", "suffix"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, prepared_model):
    out = tmp_path_factory.mktemp("serve")
    argv = ["bench", "serve", "--arms", "plain", "ngram-k4", "suffix", "--slices", *SLICES, "--per-slice", "1",
            "--max-tokens", "8", "--repeats", "2", "--loads", "c1", "--restart", "gateway", "--num-threads", "1",
            "--out", str(out)]
    proc = subprocess.run([sys.executable, "-c", CLI, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    return out, json.loads((out / "serve.json").read_text())


def test_result_file_structure(run):
    _, result = run
    assert set(result) == {"meta", "settings", "workloads", "arms", "warmup", "learning_cost", "requests"}
    assert set(result["meta"]) == {"command", "date", "cpu", "cores", "python", "torch", "transformers",
                                   "commit", "slo", "wall_s", "notes"}
    assert result["meta"]["command"].startswith("specgate bench serve --arms plain ngram-k4 suffix")
    assert result["meta"]["slo"] == {"ttft_ms": 2000.0, "tpot_ms": 150.0}  # deploy/policies/default.yaml
    assert result["settings"]["arms"] == ARMS
    assert result["settings"]["loads"] == ["c1"] and result["settings"]["slices"] == SLICES
    assert result["settings"]["repeats"] == 2
    assert [len(result["workloads"][s]) for s in SLICES] == [1, 1]
    assert list(result["arms"]) == ARMS
    for arm in result["arms"].values():
        assert list(arm["cells"]) == ["c1"] and list(arm["cells"]["c1"]) == SLICES
        for c in arm["cells"]["c1"].values():
            assert set(c) == CELL_KEYS
            assert (c["requests"], c["ok"], c["errors"]) == (2, 2, [])
            assert 2 <= c["output_tokens"] <= 16
            assert c["ttft_ms"]["p50"] > 0 and set(c["tpot_ms"]) == {"p50", "p90", "p99"}
            assert c["peak_rss_mb"] > 100  # the real model is loaded in the worker
            # goodput is computed from the unrounded wall time w; wall_s is w to 3 decimals (|w - wall_s| <= 0.0005),
            # so slo_met / wall_s is off by up to slo_met * 0.0005 / (wall_s * (wall_s - 0.0005)), and goodput's own
            # 4 decimals add 5e-5: the two bounds summed (pytest.approx takes the larger of rel and abs, not both;
            # a cell at w = 0.8355 missed by 2e-5 that way)
            bound = c["slo_met"] * 0.0005 / (c["wall_s"] * (c["wall_s"] - 0.0005)) + 5e-5
            assert c["slo_met"] in (0, 1, 2) and c["goodput_rps"] == pytest.approx(c["slo_met"] / c["wall_s"],
                                                                                  rel=0, abs=bound)
    assert result["warmup"] == [] and result["learning_cost"] is None
    assert len(result["requests"]) == 12 and all(r["ok"] and r["text"] for r in result["requests"])
    # the usage's prompt tokens: the same prompt has the same count under every arm and replicate
    counts = {}
    for r in result["requests"]:
        counts.setdefault(r["item"], set()).add(r["prompt_tokens"])
    assert all(len(c) == 1 and next(iter(c)) > 8 for c in counts.values()), counts
    served = sorted((r["arm"], r["slice"], r["rep"]) for r in result["requests"])
    assert served == sorted((a, s, rep) for a in ARMS for s in SLICES for rep in (0, 1))
    reasons = {r["arm"]: r["reason"] for r in result["requests"]}
    assert reasons["plain"] == "rule 'bench-plain' (catch-all) bypasses speculation"
    assert reasons["ngram-k4"] == "rule 'bench-ngram-k4' (catch-all) pins pool 'ngram' with k=4"
    assert reasons["suffix"] == "rule 'bench-suffix' (catch-all) pins pool 'suffix' with k=8"
    # suffix: every cell (load, slice, replicate) on its own route, so its own tree; the other arms each on one route
    # of their own (the worker is shared: no two arms draft from one tree)
    routes = {(r["arm"], r["slice"], r["rep"]): r["route"] for r in result["requests"]}
    cells = [(s, rep) for s in SLICES for rep in (0, 1)]
    assert [routes[("suffix", *c)] for c in cells] == [f"suffix.cell-{n}" for n in range(4)]
    assert [{routes[(a, *c)] for c in cells} for a in ("plain", "ngram-k4")] == [{"plain"}, {"ngram-k4"}]


def test_every_arm_is_identical_to_plain_and_decisions_are_counted(run):
    _, result = run
    for name, rule, choice in (("plain", "bench-plain", "plain:0"), ("ngram-k4", "bench-ngram-k4", "ngram:4"),
                               ("suffix", "bench-suffix", "suffix:8")):
        for c in result["arms"][name]["cells"]["c1"].values():
            # both replicates, plain's second one included, answer as plain's first did
            assert (c["identical_to_plain"], c["compared_to_plain"], c["not_identical"]) == (2, 2, [])
            assert c["decisions_by_rule"] == {rule: 2} and c["choices"] == {choice: 2}
    plain = result["arms"]["plain"]["cells"]["c1"]["code_edit"]
    ngram = result["arms"]["ngram-k4"]["cells"]["c1"]["code_edit"]
    assert plain["accept_length"] is None  # nothing was speculated
    # the cell's accept length: its requests' tokens over their verify rounds (bonus tokens included), and the
    # copy-friendly code edit gets n-gram drafts accepted, so above plain decoding's 1.0
    mine = [r for r in result["requests"] if (r["arm"], r["slice"]) == ("ngram-k4", "code_edit")]
    assert len(mine) == 2 and all(r["verify_rounds"] for r in mine)
    rounds = sum(r["verify_rounds"] for r in mine)
    assert ngram["accept_length"] == round(sum(r["completion_tokens"] for r in mine) / rounds, 3)
    assert ngram["accept_length"] > 1.0
    assert ngram["output_tokens"] == plain["output_tokens"]


def test_markdown_and_plots_are_written(run):
    out, result = run
    text = (out / "serve.md").read_text()
    assert f"Command: `{result['meta']['command']}`" in text
    assert "| ngram-k4 | c1 |" in text and "| plain | c1 |" in text
    assert "ngram-k4 vs the best fixed arm" not in text  # no adaptive arm in this run
    for name in ("serve-tpot.png", "serve-goodput.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in text


def test_the_reports_notes_follow_its_header(run):
    """A run's notes (bench.serve.arms.tree_notes) are printed under the header; this run has none."""
    from bench.serve.report import markdown

    _, result = run
    assert result["meta"]["notes"] == [] and "**Note.**" not in markdown(result)
    lines = markdown(dict(result, meta=dict(result["meta"], notes=["a warm arm spans load points."]))).split("\n")
    assert lines[2].startswith("SLO (default policy)") and lines[3:5] == ["**Note.** a warm arm spans load points.", ""]


def test_report_re_renders_from_the_result_file(run, tmp_path):
    out, _ = run
    (tmp_path / "serve.json").write_bytes((out / "serve.json").read_bytes())
    proc = subprocess.run([sys.executable, "-c", CLI, "bench", "serve", "--report", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "serve.md").read_text() == (out / "serve.md").read_text()
    assert (tmp_path / "serve-tpot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = subprocess.run([sys.executable, "-c", CLI, "bench", "serve", "--report", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "--report" in missing.stderr and "serve.json" in missing.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "serve.json.gz").write_bytes(gzip.compress(b'{"cut short')[:20])
    bad = subprocess.run([sys.executable, "-c", CLI, "bench", "serve", "--report", str(broken)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and f"--report {broken}: cannot read serve.json or serve.json.gz" in bad.stderr


def _request(arm: str, item: str, tpot_ms: float) -> dict:
    return {"arm": arm, "load": "c1", "slice": "code", "item": item, "ok": True, "tpot_s": tpot_ms / 1e3,
            "pool": arm, "draft_tokens": 0, "text": arm}


def _cell(goodput: float, tpot_p50: float) -> dict:
    return {"goodput_rps": goodput, "tpot_ms": {"p50": tpot_p50}}


def test_adaptive_against_the_best_arm_paired_by_prompt_with_an_interval():
    best = {"a": 20.0, "b": 40.0, "c": 60.0, "d": 80.0}
    requests = [_request("ngram-k8", i, t) for i, t in best.items()]
    requests += [_request("plain", i, 100.0) for i in best]
    # adaptive is 1.10x, 1.10x, 1.20x, 1.00x of ngram-k8 on the same prompts; prompt "e" has no pair
    requests += [_request("adaptive-warm", i, t * f) for (i, t), f in zip(best.items(), (1.1, 1.1, 1.2, 1.0))]
    requests.append(_request("adaptive-warm", "e", 500.0))
    ratio, low, high, n = paired_tpot_ratio(requests, "adaptive-warm", "ngram-k8", "c1", "code")
    logs = [math.log(f) for f in (1.1, 1.1, 1.2, 1.0)]
    mean = sum(logs) / 4
    half = 3.1824463052837078 * statistics.stdev(logs) / 2  # t(0.975, 3) * sd / sqrt(4)
    assert n == 4 and math.isclose(ratio, math.exp(mean))
    assert math.isclose(low, math.exp(mean - half)) and math.isclose(high, math.exp(mean + half))
    assert paired_tpot_ratio(requests, "adaptive-warm", "ngram-k8", "c4", "code") is None
    result = {"settings": {"loads": ["c1"], "slices": ["code"]}, "requests": requests,
              "arms": {"plain": {"cells": {"c1": {"code": _cell(0.2, 100.0)}}},
                       "ngram-k8": {"cells": {"c1": {"code": _cell(0.5, 50.0)}}},
                       "adaptive-warm": {"cells": {"c1": {"code": _cell(0.45, 55.0)}}}}}
    row = [line for line in _targets(result) if line.startswith("| code |")]
    assert row == [f"| code | c1 | 0.500 (ngram-k8) | 0.450 | 0.90 | 50.0 (ngram-k8) | 55.0 | 1.10 "
                   f"| {ratio:.2f} [{low:.2f}, {high:.2f}] open | 0.49 [0.19, 1.24] open | 2.25 |"]
    assert ratio > 1.03 and low < 1.03 < high  # 1.10x on four prompts: this run cannot tell
    assert _verdict((1.0, 0.9, 1.03, 4), 1.03) == "1.00 [0.90, 1.03] met"
    assert _verdict((1.1, 1.04, 1.2, 4), 1.03) == "1.10 [1.04, 1.20] missed"
    assert _verdict(None, 1.03) == "-"


def test_load_points_parse_and_reject_with_the_fix():
    assert LoadPoint.parse("c16") == LoadPoint("c16", concurrency=16)
    assert LoadPoint.parse("p0.5") == LoadPoint("p0.5", rate=0.5)
    for bad in ("x3", "c0", "p-1", "c"):
        with pytest.raises(ValueError, match=rf"--loads: '{bad}' is not a load point; use cN"):
            LoadPoint.parse(bad)


def test_arms_take_turns_per_request_at_c1_and_per_cell_under_load_in_rotating_order():
    a, b, c = (WorkItem(id=x, slice="code", source="s", messages=[]) for x in "abc")
    plain, ngram, warm = parse_arms(["ngram-k4", "adaptive-warm", "plain"])
    def order(load: str, start: int) -> list[tuple[str, list[str]]]:
        return [(arm.name, [i.id for i in g]) for arm, g in turns(LoadPoint.parse(load), [a, b, c], [plain, ngram, warm], start)]
    assert order("c1", 0) == [("plain", ["a"]), ("ngram-k4", ["a"]), ("adaptive-warm", ["a"]),
                              ("ngram-k4", ["b"]), ("adaptive-warm", ["b"]), ("plain", ["b"]),
                              ("adaptive-warm", ["c"]), ("plain", ["c"]), ("ngram-k4", ["c"])]
    assert order("c1", 4)[:3] == [("ngram-k4", ["a"]), ("adaptive-warm", ["a"]), ("plain", ["a"])]
    for load in ("c4", "p1"):
        assert order(load, 0) == [("plain", ["a", "b", "c"]), ("ngram-k4", ["a", "b", "c"]),
                                  ("adaptive-warm", ["a", "b", "c"])]
        assert [arm for arm, _ in order(load, 2)] == ["adaptive-warm", "plain", "ngram-k4"]


def test_percentile_and_learning_cost():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 50) is None
    trace = [Result(arm="adaptive-warm", load="warmup", slice=s, item=str(i), start_s=0, ok=True, tpot_s=t)
             for i, (s, t) in enumerate([("code", 0.1), ("prose", 0.05), ("code", 0.1), ("code", 0.05),
                                         ("code", 0.05), ("code", 0.05)], 1)]
    cost = learning_cost(trace, {"code": 50.0, "prose": 50.0})
    # code: rolling means of 3 = 83.3, 66.7, 50.0 -> within 5% at its 5th request, 6th overall
    assert cost["code"] == {"requests": 6, "slice_requests": 5, "rolling_tpot_ms": 50.0, "warm_tpot_p50_ms": 50.0}
    assert cost["prose"] == {"requests": None, "slice_requests": 1, "warm_tpot_p50_ms": 50.0}
    # decisions (in trace order, prose 2nd): code served plain, explored ngram, then ngram:8 from its 3rd
    # request on (4th overall); a later exploration of plain does not unsettle it; prose never chose ngram:8
    choices = [("plain", 0, ""), ("plain", 0, ""), ("ngram", 8, "auto: exploring cold pool 'ngram'"),
               ("ngram", 8, ""), ("plain", 0, "auto: exploring stale plain decoding"), ("ngram", 8, "")]
    for r, (pool, k, reason) in zip(trace, choices):
        r.pool, r.draft_tokens, r.reason = pool, k, reason
    cost = learning_cost(trace, {"code": 50.0, "prose": 50.0}, {"code": "ngram:8", "prose": "ngram:8"})
    assert (cost["code"]["settled"], cost["code"]["settled_slice_requests"], cost["code"]["warm_choice"]) == (4, 3, "ngram:8")
    assert (cost["prose"]["settled"], cost["prose"]["settled_slice_requests"]) == (None, None)


def _as_load(result: dict, load: str) -> dict:
    """The run's result as if it had measured load point ``load`` instead of c1."""
    out = json.loads(json.dumps(result))
    out["settings"]["loads"] = [load]
    for arm in out["arms"].values():
        arm["cells"] = {load: arm["cells"]["c1"]}
    for r in out["requests"]:
        r["load"] = load
    out["meta"].update(command=out["meta"]["command"].replace("--loads c1", f"--loads {load}"), wall_s=10.0)
    return out


def test_merge_joins_one_run_per_load_point_and_refuses_runs_of_other_commands(run, tmp_path):
    out, result = run
    other = tmp_path / "c2"
    other.mkdir()
    # a part kept compressed in git (docs/runs/) is read as it is
    (other / "serve.json.gz").write_bytes(gzip.compress(json.dumps(_as_load(result, "c2")).encode()))
    merged_dir = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-c", CLI, "bench", "serve", "--merge", str(out), str(other),
                           "--out", str(merged_dir)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads((merged_dir / "serve.json").read_text())
    assert merged["settings"] == dict(result["settings"], loads=["c1", "c2"])
    assert [list(a["cells"]) for a in merged["arms"].values()] == [["c1", "c2"]] * len(ARMS)
    assert merged["arms"]["plain"]["cells"]["c2"] == result["arms"]["plain"]["cells"]["c1"]
    assert len(merged["requests"]) == 2 * len(result["requests"])
    assert [p["dir"] for p in merged["meta"]["parts"]] == [str(out), str(other)]
    assert merged["meta"]["wall_s"] == round(result["meta"]["wall_s"] + 10.0, 1)
    assert merged["meta"]["command"].endswith("--loads c2 --restart gateway --num-threads 1 --out " + str(out))
    text = (merged_dir / "serve.md").read_text()
    assert "| ngram-k4 | c1 |" in text and "| ngram-k4 | c2 |" in text
    assert f"Merged from one run per load point (each with its own gateways and warm-up): `{out}`" in text

    from bench.serve.merge import merge

    with pytest.raises(ValueError, match=r"--merge: b has settings.max_tokens = 16, a has 8; merge only runs"):
        merge([result, dict(_as_load(result, "c2"), settings=dict(result["settings"], loads=["c2"], max_tokens=16))],
              ["a", "b"])
    with pytest.raises(ValueError, match=r"--merge: b has meta.commit = 'other', a has"):
        merge([result, dict(result, meta=dict(result["meta"], commit="other"))], ["a", "b"])
    with pytest.raises(ValueError, match=r"--merge: load point c1 is in both a and b; keep one"):
        merge([result, result], ["a", "b"])
    with pytest.raises(ValueError, match=r"needs at least two"):
        merge([result])
    clobber = subprocess.run([sys.executable, "-c", CLI, "bench", "serve", "--merge", str(out), str(other), "--out",
                              str(other)], capture_output=True, text=True, timeout=120)
    assert clobber.returncode == 2 and "is one of the merged directories" in clobber.stderr
