"""The serving benchmark's analyses of its own result file: same-configuration (A/A) comparisons, the
between-run variance they size, the widened paired intervals at concurrent loads, the duration estimate."""

from __future__ import annotations

import math
import statistics

import pytest
from scipy import stats

from bench.serve.analyse import (between_cells_variance, duration_estimate, explorations, noise_by_load,
                                 same_config_cells, same_config_requests, section)
from bench.serve.report import _by_workload_slice, _targets, _verdict, paired_tpot_ratio


def _req(arm: str, load: str, item: str, config: str, tpot_ms: float, text: str = "same", slice_: str = "code",
         **extra) -> dict:
    pool, k = config.split(":")
    return {"arm": arm, "load": load, "slice": slice_, "item": item, "ok": True, "tpot_s": tpot_ms / 1e3,
            "pool": pool, "draft_tokens": int(k), "text": text, "ttft_s": 0.1, "e2e_s": 1.0,
            "completion_tokens": 8, **extra}


def _result(requests: list[dict], loads: list[str]) -> dict:
    arms = ("plain", "ngram-k8", "adaptive-warm")
    cell = {"goodput_rps": 0.1, "tpot_ms": {"p50": 50.0}, "wall_s": 1.0}
    return {"settings": {"arms": list(arms), "loads": loads, "slices": ["code"], "per_slice": 3},
            "arms": {a: {"cells": {ld: {"code": dict(cell)} for ld in loads}} for a in arms},
            "requests": requests}


# adaptive-warm over ngram-k8, per prompt, in the two concurrent cells where it served ngram:8 throughout
C4 = {"a": 1.2, "b": 1.1, "c": 1.3}
P1 = {"a": 0.9, "b": 1.0, "c": 0.8}


def _requests() -> list[dict]:
    reqs = []
    for load, factors in (("c4", C4), ("p1", P1)):
        for item, f in factors.items():
            reqs += [_req("plain", load, item, "plain:0", 100.0), _req("ngram-k8", load, item, "ngram:8", 40.0),
                     _req("adaptive-warm", load, item, "ngram:8", 40.0 * f)]
    # c1: adaptive-warm served ngram:8 on a, b (one answered differently: no pair) and plain on c
    reqs += [_req("plain", "c1", i, "plain:0", 100.0) for i in "abc"]
    reqs += [_req("ngram-k8", "c1", i, "ngram:8", 40.0) for i in "abc"]
    reqs += [_req("adaptive-warm", "c1", "a", "ngram:8", 42.0), _req("adaptive-warm", "c1", "b", "ngram:8", 30.0, "other"),
             _req("adaptive-warm", "c1", "c", "plain:0", 95.0)]
    return reqs


def test_same_configuration_pairs_need_the_same_pool_k_and_the_same_text():
    result = _result(_requests(), ["c1", "c4", "p1"])
    c1 = [(arms, round(math.exp(x), 6)) for load, _, arms, x in same_config_requests(result) if load == "c1"]
    assert c1 == [(("adaptive-warm", "plain"), 0.95), (("adaptive-warm", "ngram-k8"), 1.05)]
    cells = same_config_cells(result)
    assert [(c.load, c.arms, c.config) for c in cells] == [("c4", ("adaptive-warm", "ngram-k8"), "ngram:8"),
                                                          ("p1", ("adaptive-warm", "ngram-k8"), "ngram:8")]
    assert math.isclose(cells[0].ratio, (1.2 * 1.1 * 1.3) ** (1 / 3))


def test_between_run_variance_by_the_method_of_moments():
    cells = same_config_cells(_result(_requests(), ["c1", "c4", "p1"]))
    terms = []
    for factors in (C4, P1):
        logs = [math.log(f) for f in factors.values()]
        terms.append(statistics.fmean(logs) ** 2 - statistics.variance(logs) / 3)
    var, n = between_cells_variance(cells)
    assert n == 2 and math.isclose(var, statistics.fmean(terms)) and var > 0
    assert between_cells_variance(cells[:1]) is None  # one cell cannot size it


def test_concurrent_loads_widen_the_paired_interval_or_leave_it_unsized():
    requests = [_req("ngram-k8", "c4", i, "ngram:8", t) for i, t in zip("abcd", (20.0, 40.0, 60.0, 80.0))]
    requests += [_req("adaptive-warm", "c4", i, "ngram:8", t * f, text=i)
                 for i, t, f in zip("abcd", (20.0, 40.0, 60.0, 80.0), (1.1, 1.1, 1.2, 1.0))]
    logs = [math.log(f) for f in (1.1, 1.1, 1.2, 1.0)]
    mean, within = statistics.fmean(logs), statistics.variance(logs) / 4
    narrow = paired_tpot_ratio(requests, "adaptive-warm", "ngram-k8", "c4", "code")
    ratio, low, high, n = paired_tpot_ratio(requests, "adaptive-warm", "ngram-k8", "c4", "code", (0.01, 5))
    df = (within + 0.01) ** 2 / (within ** 2 / 3 + 0.01 ** 2 / 5)
    half = stats.t.ppf(0.975, df) * math.sqrt(within + 0.01)
    assert n == 4 and math.isclose(ratio, math.exp(mean)) and math.isclose(high, math.exp(mean + half))
    assert math.isclose(low, math.exp(mean - half)) and low < narrow[1] and high > narrow[2]
    unsized = paired_tpot_ratio(requests, "adaptive-warm", "ngram-k8", "c4", "code", (math.nan, 0))
    assert _verdict(unsized, 1.03) == f"{math.exp(mean):.2f} [unsized] open"


def test_the_target_table_uses_the_runs_own_noise_at_concurrent_loads_only():
    reqs = _requests()
    # a third cell at c16 where adaptive-warm served plain: paired against plain with the between variance
    reqs += [_req(a, "c16", i, "plain:0", 100.0 * f) for i, f in zip("abc", (1.0, 1.1, 0.9))
             for a in ("plain", "ngram-k8")]
    reqs += [_req("adaptive-warm", "c16", i, "plain:0", 100.0 * f * g, text=i)
             for i, f, g in zip("abc", (1.0, 1.1, 0.9), (1.0, 1.02, 0.98))]
    result = _result(reqs, ["c1", "c4", "p1", "c16"])
    noise = between_cells_variance(same_config_cells(result))
    rows = {line.split(" | ")[1]: line for line in _targets(result) if line.startswith("| code |")}
    expect = _verdict(paired_tpot_ratio(reqs, "adaptive-warm", "ngram-k8", "c16", "code", noise), 1.03)
    assert expect in rows["c16"] and "unsized" not in rows["c16"]
    alone = _result([r for r in reqs if r["load"] in ("c1", "c16")], ["c1", "c16"])  # no A/A cell under load
    rows = {line.split(" | ")[1]: line for line in _targets(alone) if line.startswith("| code |")}
    assert "[unsized] open" in rows["c16"] and "unsized" not in rows["c1"]
    text = "\n".join(section(result))
    assert "| c4 | 3 | 1.200 | 1.12-1.28 | 1 | 1.20-1.20 |" in text
    assert f"standard deviation of a cell's log TPOT ratio {math.sqrt(noise[0]):.3f} (from 2 same-configuration" in text


def test_duration_estimate_scales_requests_and_decode_tokens():
    # one cell: 2 requests, each 1 s to first token of 4 s end to end, 9 tokens; wall 6 s
    reqs = [dict(_req("plain", "c1", i, "plain:0", 375.0), ttft_s=1.0, e2e_s=4.0, completion_tokens=9) for i in "ab"]
    result = {"settings": {"per_slice": 2}, "requests": reqs,
              "arms": {"plain": {"cells": {"c1": {"code": {"wall_s": 6.0}}}}},
              "warmup": [dict(reqs[0], arm="adaptive-warm", load="warmup")]}
    est = duration_estimate(result, per_slice=4, max_tokens=17, loads=3)
    # x2 requests; TTFT share 1/4 stays, decode share 3/4 x (17-1)/(9-1) = 2: 6 * 2 * (0.25 + 1.5) = 21
    assert est["per_load_s"] == {"c1": 21} and est["mean_load_s"] == 21
    # warm-up: 4 s * (0.25 + 1.5) = 7; total 3 * 21 + 7
    assert est["warmup_s"] == 7 and est["total_s"] == 70


def test_explorations_are_counted_per_adaptive_arm_and_load_from_the_decision_reasons():
    why = "rule 'learned' auto: exploring "
    reqs = [_req("adaptive-warm", "p1", "a", "ngram:4", 50.0,
                 reason=why + "the cost slope of pool 'ngram' k=4 (80 rounds of evidence)"),
            _req("adaptive-warm", "p1", "b", "plain:0", 90.0, reason=why + "unconfirmed plain decoding (20 tokens of "
                 "evidence)"),
            _req("adaptive-warm", "p1", "c", "ngram:8", 40.0, reason="rule 'learned' auto: pool 'ngram' k=8 predicted "
                 "speedup 1.40x (E[accept length] 2.10)"),
            _req("adaptive-warm", "c4", "a", "plain:0", 90.0, reason=why + "unconfirmed plain decoding (3 tokens of "
                 "evidence)"),
            _req("ngram-k8", "p1", "a", "ngram:8", 40.0, reason=why + "never counted: a fixed arm")]
    got = explorations(_result(reqs, ["c4", "p1"]))
    assert {key: (n, dict(kinds)) for key, (n, kinds) in got.items()} == {
        ("adaptive-warm", "p1"): (3, {"the cost slope of pool 'ngram' k=4": 1, "unconfirmed plain decoding": 1}),
        ("adaptive-warm", "c4"): (1, {"unconfirmed plain decoding": 1})}
    # the gateway's explored flag, where recorded, decides; the pool and k name what a terse reason does not
    flagged = [_req("adaptive-warm", "c4", "b", "ngram:2", 60.0, reason="rule 'learned' auto: measuring",
                    explored=True),
               _req("adaptive-warm", "c4", "c", "plain:0", 90.0, reason=why + "but not flagged", explored=False)]
    got = explorations(_result(reqs + flagged, ["c4", "p1"]))
    assert (got["adaptive-warm", "c4"][0], dict(got["adaptive-warm", "c4"][1])) == (
        3, {"unconfirmed plain decoding": 1, "pool 'ngram' k=2": 1})
    text = "\n".join(section(_result(reqs, ["c4", "p1"])))
    assert ("| adaptive-warm | p1 | 2 / 3 | the cost slope of pool 'ngram' k=4 1, unconfirmed plain decoding 1 |"
            in text)
    # today's reasons (policies/decide.py, Thompson sampling): "auto: exploring WHAT (why), ..."
    today = [_req("adaptive-warm", "c1", "a", "ngram:2", 60.0, explored=True, reason=why + "pool 'ngram' k=2 "
                  "(never measured here), posterior-mean speedup 1.00x over plain"),
             _req("adaptive-warm", "c1", "b", "plain:0", 90.0, explored=True, reason=why + "plain decoding "
                  "(a posterior draw)")]
    got = explorations(_result(today, ["c1"]))
    assert dict(got["adaptive-warm", "c1"][1]) == {"pool 'ngram' k=2": 1, "plain decoding": 1}


def _replicated() -> dict:
    """c4 served twice by every arm (``--repeats 2``): adaptive-warm served ngram:8 throughout."""
    reqs = []
    for rep, slow in ((0, 1.0), (1, 1.25)):  # the machine ran the second replicate 25% slower
        for item, t in zip("abc", (40.0, 60.0, 80.0)):
            reqs += [_req("plain", "c4", item, "plain:0", 2.5 * t * slow, rep=rep),
                     _req("ngram-k8", "c4", item, "ngram:8", t * slow, rep=rep),
                     _req("adaptive-warm", "c4", item, "ngram:8", t * slow * (1.1 if item == "a" else 1.0), rep=rep)]
    result = _result(reqs, ["c4"])
    result["settings"]["repeats"] = 2
    return result


def test_replicates_pair_each_arm_with_itself_and_arms_within_a_replicate():
    result = _replicated()
    cells = same_config_cells(result)
    assert [c.arms for c in cells] == [("adaptive-warm", "ngram-k8"), ("adaptive-warm", "ngram-k8"),
                                       ("plain", "plain"), ("ngram-k8", "ngram-k8"), ("adaptive-warm", "adaptive-warm")]
    # within a replicate adaptive is 1.1x on prompt a only; an arm's later replicate is 1.25x its earlier one
    for c in cells[:2]:
        assert [round(math.exp(x), 6) for x in c.logs] == [1.1, 1.0, 1.0]
    assert all(math.isclose(c.ratio, 1.25) for c in cells[2:])
    var, n = between_cells_variance(cells)
    d = statistics.fmean([math.log(1.1), 0, 0])
    assert n == 5 and math.isclose(var, (2 * (d * d - statistics.variance([math.log(1.1), 0, 0]) / 3)
                                         + 3 * math.log(1.25) ** 2) / 5)
    text = "\n".join(section(result, cells))
    assert "(from 5 same-configuration cells, 3 of them an arm against its own replicate; per load point: c4 " in text
    assert "(divided by the 2 replicates each side averages)" in text


def test_paired_interval_averages_replicates_and_divides_the_between_variance_by_them():
    result = _replicated()
    reqs = result["requests"]
    # the per-prompt ratio is of geometric means over both replicates: the 25% slow spell cancels
    one = paired_tpot_ratio(reqs, "adaptive-warm", "ngram-k8", "c4", "code", (0.02, 5), repeats=2)
    logs = [math.log(1.1), 0.0, 0.0]
    mean, within = statistics.fmean(logs), statistics.variance(logs) / 3
    df = (within + 0.01) ** 2 / (within ** 2 / 2 + 0.01 ** 2 / 5)
    half = stats.t.ppf(0.975, df) * math.sqrt(within + 0.01)
    assert one[3] == 3 and math.isclose(one[0], math.exp(mean))
    assert math.isclose(one[1], math.exp(mean - half)) and math.isclose(one[2], math.exp(mean + half))
    single = paired_tpot_ratio(reqs, "adaptive-warm", "ngram-k8", "c4", "code", (0.02, 5))
    assert single[1] < one[1] and single[2] > one[2]  # the same variance counted once is wider
    est = duration_estimate(dict(result, warmup=[]), per_slice=6, max_tokens=8, loads=1)
    assert est["per_load_s"] == {"c4": 3}  # each arm's 1 s cell held 2 x 3 requests: per_slice 6 is 1x


def test_repeats_below_one_are_refused_naming_the_flag():
    import argparse

    import pytest

    from bench.serve.cli import add_arguments, apply_preset

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert apply_preset(parser.parse_args(["--repeats", "3"])).repeats == 3
    assert apply_preset(parser.parse_args([])).repeats == 1
    with pytest.raises(ValueError, match=r"--repeats must be >= 1 \(got 0\)"):
        apply_preset(parser.parse_args(["--repeats", "0"]))


def test_a_load_point_with_enough_aa_cells_has_its_own_noise_the_others_the_pooled_one():
    from bench.serve.analyse import OWN_CELLS, SameConfigCell, noise_by_load

    def cells(load: str, n: int, shift: float) -> list[SameConfigCell]:
        return [SameConfigCell(load, f"s{i}", ("plain", "plain"), "plain:0",
                               (shift * (-1) ** i + 0.01, shift * (-1) ** i - 0.01)) for i in range(n)]

    quiet, loud = cells("c4", OWN_CELLS, 0.02), cells("p1", 3, 0.2)
    result = {"settings": {"loads": ["c1", "c4", "p1"]}}
    noise = noise_by_load(result, quiet + loud)
    assert noise["c4"] == (*between_cells_variance(quiet), True)
    assert noise["p1"] == (*between_cells_variance(quiet + loud), False) and "c1" not in noise
    assert math.isclose(noise["c4"][0], 0.02 ** 2 - 0.0002 / 2)  # d = +-0.02, s^2 = 2 x 0.01^2, n = 2
    assert noise_by_load(result, quiet[:OWN_CELLS - 1])["c4"][2] is False  # one cell short: pooled
    assert math.isnan(noise_by_load(result, [])["c4"][0])
    text = "\n".join(section(dict(_result([], ["c4", "p1"]), settings={"loads": ["c4", "p1"], "slices": ["code"],
                                                                         "per_slice": 3}), quiet + loud))
    p1 = between_cells_variance(loud)[0]
    assert (f"; per load point: c4 {math.sqrt(noise['c4'][0]):.3f} (10), p1 {math.sqrt(p1):.3f} (3), its own used "
            f"where it has {OWN_CELLS} or more cells)") in text
    # the narrowest interval each load allows: c4 its own sd sqrt(0.0003) = 0.0173 -> +-3.5%; p1 the pooled one
    floor = {load: math.exp(1.96 * math.sqrt(noise[load][0])) - 1 for load in ("c4", "p1")}
    assert (f"c4 ±{100 * floor['c4']:.1f}%, p1 ±{100 * floor['p1']:.1f}% (1.96 x its standard deviation / "
            "sqrt(1))") in text
    assert round(100 * floor["c4"], 1) == 3.5


def test_an_interleaved_run_reports_the_adaptive_arm_per_slice_the_requests_came_from():
    """One "mixed" cell per load, but each request keeps its ``workload_slice``: the table pairs the adaptive arm
    with each fixed arm per slice, sized at c1 (sequential requests), unsized under load without A/A cells."""
    factors = {"code": (0.8, 0.9), "tool_call": (1.1, 1.2)}  # adaptive-warm over ngram-k8, two prompts per slice
    reqs = []
    for load in ("c1", "c4"):
        for kind, fs in factors.items():
            for n, f in enumerate(fs):
                item = f"{kind}-{n}"
                reqs += [_req(a, load, item, c, t, slice_="mixed", workload_slice=kind) for a, c, t in (
                    ("plain", "plain:0", 100.0), ("ngram-k8", "ngram:8", 40.0), ("adaptive-warm", "ngram:8", 40.0 * f))]
    result = _result(reqs, ["c1", "c4"])
    result["settings"].update(slices=["mixed"], mix="interleaved")
    lines = _by_workload_slice(result, noise_by_load(result, same_config_cells(result)))
    assert lines[1] == "| load | over | all | code | tool_call |"
    rows = {tuple(line.split(" | ")[:2]): line for line in lines[3:]}
    assert set(rows) == {(f"| {ld}", a) for ld in ("c1", "c4") for a in ("plain", "ngram-k8")}
    code = paired_tpot_ratio(reqs, "adaptive-warm", "ngram-k8", "c1", "code", field="workload_slice")
    assert code[0] == pytest.approx(math.sqrt(0.8 * 0.9)) and code[3] == 2
    assert f"| {code[0]:.3f} [{code[1]:.2f}, {code[2]:.2f}] |" in rows[("| c1", "ngram-k8")]
    assert f"| {math.sqrt(1.1 * 1.2):.3f} [" in rows[("| c1", "ngram-k8")]
    assert rows[("| c4", "ngram-k8")].endswith(f"| {math.sqrt(1.1 * 1.2):.3f} [unsized] |")
    result["settings"]["mix"] = "by-slice"
    assert _by_workload_slice(result, {}) == []
