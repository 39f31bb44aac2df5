"""bench.replay_fidelity on an interleaved serving run (``bench serve --mix interleaved``): the run's own order is
replayed, the measured cells are the run's ``mixed`` cell and each request's own slice over all replicates,
and a trace that does not hold the run's requests is refused. The synthetic trace and cost model of
test_replay_cli, whose replayed TPOTs are computed there by hand."""

from __future__ import annotations

import gzip
import json
import math

import pytest

from bench import replay_fidelity
from replay.book import RoundBook
from replay.choosers import Prices
from replay.report import percentile
from replay.run import parse_arm, sweep
from policies.costmodel import write_cost_model
from policies.trace import FORMAT, Header, read_trace, write_trace
from tests.replay.replay_helpers import (CODE_NGRAM_TPOT, PLAIN_TPOT, PROSE_NGRAM_TPOT, REQUESTS, REVISION,
                                          costs)

ORDER = ["p2", "c1", "p1", "c2"]  # the run's stream: not the trace's order (c1, p1, c2, p2)
SLICE = {r.id: r.slice for r in REQUESTS}
REPLAYED = {("plain", "code"): PLAIN_TPOT, ("plain", "prose"): PLAIN_TPOT,
            ("ngram-k4", "code"): CODE_NGRAM_TPOT, ("ngram-k4", "prose"): PROSE_NGRAM_TPOT}
ROUNDS = {("plain", "code"): 12, ("plain", "prose"): 12, ("ngram-k4", "code"): 3, ("ngram-k4", "prose"): 12}
# measured = replayed x this: plain 5% slow everywhere; ngram-k4 on code 20% slow (outside the c1 bar), prose exact
SLOWER = {("plain", "code"): 1.05, ("plain", "prose"): 1.05, ("ngram-k4", "code"): 1.2, ("ngram-k4", "prose"): 1.0}


def serving_run(reps: int = 2) -> dict:
    requests = []
    for arm in ("plain", "ngram-k4"):
        for rep in range(reps):
            for item in ORDER:
                key = (arm, SLICE[item])
                requests.append({"arm": arm, "load": "c1", "slice": "mixed", "item": item, "ok": True, "rep": rep,
                                 "tpot_s": REPLAYED[key] * SLOWER[key] * (1 + rep / 100), "ttft_s": 0.05,
                                 "verify_rounds": ROUNDS[key], "workload_slice": SLICE[item]})
    cells = {arm: {"c1": {"mixed": {
        "tpot_ms": {"p50": percentile([r["tpot_s"] * 1e3 for r in requests if r["arm"] == arm], 50)},
        "ttft_ms": {"p50": 50.0}}}} for arm in ("plain", "ngram-k4")}
    return {"settings": {"arms": ["plain", "ngram-k4"], "loads": ["c1"], "mix": "interleaved",
                         "max_running_requests": 4, "seed": 0},
            "workloads": {"mixed": [{"id": i, "slice": SLICE[i]} for i in ORDER]},
            "arms": {arm: {"cells": cells[arm]} for arm in cells}, "requests": requests}


@pytest.fixture
def files(tmp_path):
    trace, cost_file, run = tmp_path / "t.jsonl", tmp_path / "costs.json", tmp_path / "serve.json.gz"
    write_trace(trace, Header(format=FORMAT, model="m", revision=REVISION, tokenizer="t"), REQUESTS)
    write_cost_model(cost_file, costs())
    run.write_bytes(gzip.compress(json.dumps(serving_run()).encode()))
    return trace, cost_file, run


def test_the_run_order_is_the_runs_stream_and_a_foreign_trace_is_refused(files):
    trace = read_trace(files[0])
    run = serving_run()
    assert replay_fidelity.run_order(run, trace) == [[3, 0, 1, 2]]
    run["workloads"]["mixed"][0]["slice"] = "code"  # p2 under another slice
    assert replay_fidelity.run_order(run, trace) is None
    run = serving_run()
    del run["workloads"]["mixed"][1]  # c1 missing
    assert replay_fidelity.run_order(run, trace) is None
    by_slice = {"settings": {"mix": "by-slice"},
                "workloads": {"code": [{"id": "c1"}, {"id": "c2"}], "prose": [{"id": "p1"}, {"id": "p2"}]}}
    assert replay_fidelity.run_order(by_slice, trace) == [[0, 2], [1, 3]]
    by_slice["workloads"]["code"].reverse()  # a by-slice cell in another order than the trace's: not its run
    assert replay_fidelity.run_order(by_slice, trace) is None


def test_sweep_serves_a_given_order(files):
    trace = read_trace(files[0])
    book = RoundBook(trace)
    served = sweep(Prices(book, costs()), [parse_arm("plain", book)], ["c1"], 1, "interleaved", max_running=4,
                   max_total_tokens=4096, order=[[3, 0, 1, 2]])[("plain", "c1", 0)]
    assert [s.index for s in sorted(served, key=lambda s: s.arrival)] == [3, 0, 1, 2]


def test_interleaved_run_cells_per_slice_against_measured(files, capsys):
    trace, cost_file, run = files
    assert replay_fidelity.main(["--trace", str(trace), "--costs", str(cost_file), "--run", str(run),
                                 "--processes", "1", "--ngram", "1", "12", "earliest"]) == 0
    out = capsys.readouterr().out
    absolute = out.split("target forwards")[0]  # the first table (the second: each arm relative to plain)
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): [c.strip() for c in line.split("|")[4:8]]
            for line in absolute.splitlines() if line.startswith(("| plain", "| ngram-k4"))}
    for (arm, slice_), factor in SLOWER.items():
        measured = 1e3 * REPLAYED[(arm, slice_)] * factor * 1.005  # the p50 of the two replicates (+0%, +1%)
        predicted = 1e3 * REPLAYED[(arm, slice_)]
        cell = rows[(arm, "c1", slice_)]
        assert cell[:2] == [f"{measured:.1f}", f"{predicted:.1f}"]
        assert cell[2] == f"{predicted / measured:.3f}"
        assert cell[3] == ("yes" if abs(predicted / measured - 1) <= 0.10 else "NO")
    mixed = percentile([1e3 * REPLAYED[(a, SLICE[i])] for a in ("ngram-k4",) for i in ORDER], 50)
    assert rows[("ngram-k4", "c1", "mixed")][1] == f"{mixed:.1f}"
    assert "fixed arms 16 equal, 0 different" in out  # 2 arms x 4 requests x 2 replicates, rounds exact
    assert "5 of 6 cells within the bar" in out  # ngram-k4's code cell is the one outside
    relative = {tuple(c.strip() for c in line.split("|")[1:4]): line.split("|")[6].strip()
                for line in out.split("target forwards")[1].splitlines() if line.startswith("| ngram-k4")}
    # mixed: ngram-k4's p50 over plain's, replayed (plain replays PLAIN_TPOT for every request) over the run's
    # own mixed cells (the p50 over each arm's requests of every slice and replicate)
    cells = {arm: serving_run()["arms"][arm]["cells"]["c1"]["mixed"]["tpot_ms"]["p50"] for arm in ("plain", "ngram-k4")}
    mixed_relative = (mixed / (1e3 * PLAIN_TPOT)) / (cells["ngram-k4"] / cells["plain"])
    assert relative == {("ngram-k4", "c1", "code"): f"{1.05 / 1.2:.3f}", ("ngram-k4", "c1", "prose"): f"{1.05:.3f}",
                        ("ngram-k4", "c1", "mixed"): f"{mixed_relative:.3f}"}
    # paired: geomean over the 4 requests of ngram-k4's TPOT over plain's (each request's replicates alike)
    code, prose = CODE_NGRAM_TPOT / PLAIN_TPOT, PROSE_NGRAM_TPOT / PLAIN_TPOT
    measured = math.sqrt(code * 1.2 / 1.05 * prose / 1.05)
    assert f"| c1 | ngram-k4 / plain | {measured:.3f} | {math.sqrt(code * prose):.3f} |" in out


def test_a_trace_without_the_runs_requests_is_refused(files, tmp_path, capsys):
    trace, cost_file, _ = files
    run = serving_run()
    run["workloads"]["mixed"].append({"id": "x9", "slice": "code"})
    path = tmp_path / "other.json"
    path.write_text(json.dumps(run))
    assert replay_fidelity.main(["--trace", str(trace), "--costs", str(cost_file), "--run", str(path)]) == 1
    assert "the trace does not hold the run's requests" in capsys.readouterr().err


def test_serving_concurrent_s_is_fitted_so_replays_plain_p50_at_the_load_is_the_runs(files, capsys):
    from msgspec import structs

    trace = read_trace(files[0])
    book = RoundBook(trace)
    order = [[3, 0, 1, 2]]
    truth = structs.replace(costs(), serving_concurrent_s=0.0123)
    plain = parse_arm("plain", book)
    served = sweep(Prices(book, truth), [plain], ["c2"], 1, "by-slice", max_running=16, max_total_tokens=65536,
                   order=order)[("plain", "c2", 0)]
    run = serving_run()
    run["requests"] += [{"arm": "plain", "load": "c2", "ok": True, "tpot_s": s.tpot} for s in served]
    fitted = replay_fidelity.fit_serving_concurrent(run, book, costs(), "c2", order)
    assert fitted.serving_concurrent_s == pytest.approx(0.0123, abs=2e-6)
    assert structs.replace(fitted, serving_concurrent_s=None) == costs()  # nothing else changed
    assert "serving_concurrent_s fitted on 4 plain c2 requests: 12.3 ms per round" in capsys.readouterr().out
    assert replay_fidelity.fit_serving_concurrent(run, book, costs(), "c4", order) is None


def test_fit_serving_streams_fits_a_table_entry_per_closed_load_and_refuses_other_loads(files, capsys, tmp_path):
    from msgspec import structs

    trace_file, cost_file, _ = files
    book = RoundBook(read_trace(trace_file))
    order = [[3, 0, 1, 2]]
    truth = structs.replace(costs(), serving_streams=[2, 3], serving_streams_s=[0.0123, 0.004])
    plain = parse_arm("plain", book)
    run = serving_run()
    for load in ("c2", "c3"):
        served = sweep(Prices(book, truth), [plain], [load], 1, "by-slice", max_running=4, max_total_tokens=65536,
                       order=order)[("plain", load, 0)]
        run["requests"] += [{"arm": "plain", "load": load, "ok": True, "tpot_s": s.tpot, "item": f"x{s.index}"}
                            for s in served]
    fitted = replay_fidelity.fit_serving_concurrent(run, book, costs(), "c2", order, streams=2)
    fitted = replay_fidelity.fit_serving_concurrent(run, book, fitted, "c3", order, streams=3)
    assert fitted.serving_streams == [2, 3] and fitted.serving_concurrent_s is None
    assert fitted.serving_streams_s == [pytest.approx(0.0123, abs=2e-6), pytest.approx(0.004, abs=2e-6)]
    out = capsys.readouterr().out
    assert "serving_streams_s at 3 streams fitted on 4 plain c3 requests: 4.0 ms per round" in out
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    args = ["--trace", str(trace_file), "--costs", str(cost_file), "--run", str(path), "--loads", "c1"]
    assert replay_fidelity.main([*args, "--fit-serving-streams", "c3", "c2"]) == 0
    assert "serving_streams_s at 2 streams" in capsys.readouterr().out  # c2 first: ascending
    assert replay_fidelity.main([*args, "--fit-serving-streams", "p0.5"]) == 2
    assert "--fit-serving-streams: give closed-loop loads of 2 or more clients" in capsys.readouterr().err
    assert replay_fidelity.main([*args, "--fit-serving-streams", "c8"]) == 2
    assert "--fit-serving-streams: the run has no plain requests at c8" in capsys.readouterr().err
