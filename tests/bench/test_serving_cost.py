"""bench.serving_cost and bench.serving_fit: replay's TPOT of a plain request (the synthetic cost model of
test_replay_cli, whose plain TPOT is computed there by hand), serving_s as the median gap, the prompts it cuts,
and the cost model it writes (only serving_s changed); the measurement itself, which starts a real worker and
gateway, stubbed."""

from __future__ import annotations

import pytest

import bench.serving_cost as serving_cost
from bench.serving_fit import replayed_tpot
from policies.costmodel import load_cost_model, write_cost_model
from tests.replay.replay_helpers import PLAIN_TPOT, REVISION, costs


def test_replayed_tpot_is_replays_plain_tpot():
    # 18 prompt tokens, 12 output tokens: test_replay_cli's requests, plain
    assert replayed_tpot(costs(), 18, 12) == pytest.approx(PLAIN_TPOT, rel=1e-12)


def test_serving_s_is_the_median_gap_and_never_negative():
    measured = [(18, 12, PLAIN_TPOT + 0.004), (18, 12, PLAIN_TPOT + 0.010), (18, 12, PLAIN_TPOT + 0.005),
                (18, 1, 9.0)]  # one token: no TPOT, left out
    serving, gaps = serving_cost.fit(costs(), measured)
    assert gaps == pytest.approx([0.004, 0.010, 0.005], abs=1e-12)
    assert serving == pytest.approx(0.005, abs=1e-12)
    assert serving_cost.fit(costs(), [(18, 12, PLAIN_TPOT - 0.002)])[0] == 0.0
    with pytest.raises(ValueError, match="two tokens"):
        serving_cost.fit(costs(), [(18, 1, 0.1)])


def test_prompts_cycle_through_the_lengths():
    text = "".join(chr(65 + i % 26) for i in range(20_000))
    out = serving_cost.prompts(text, 6)
    head = "Continue this text:\n\n"
    assert [len(p) - len(head) for p in out] == [300, 1200, 3000, 6000, 300, 1200]
    assert all(p.startswith(head) and p[len(head):] in text for p in out)


def test_main_writes_the_cost_model_with_serving_s(tmp_path, monkeypatch, capsys):
    path, out = tmp_path / "costs.json", tmp_path / "with-serving.json"
    write_cost_model(path, costs())
    monkeypatch.setattr(serving_cost, "measure", lambda texts, max_tokens, log_dir: [
        (18, 12, PLAIN_TPOT + gap) for gap in (0.003, 0.006, 0.004)])
    monkeypatch.setattr("backends.engine.model_store.load_prepared", lambda: type("P", (), {"revision": REVISION}))
    assert serving_cost.main(["--costs", str(path), "--out", str(out), "--requests", "3"]) == 0
    written = load_cost_model(out)
    assert written.serving_s == pytest.approx(0.004, abs=1e-9)
    assert written.forward == costs().forward and written.overhead_s == costs().overhead_s
    text = capsys.readouterr().out
    assert "serving_s = 4.00 ms per streamed round (median of 3 gaps" in text
    assert f"| p0 | 18 | 12 | {PLAIN_TPOT * 1e3 + 3:.1f} | {PLAIN_TPOT * 1e3:.1f} | 3.0 |" in text


def test_repeats_keep_the_median_measurement_of_c1_and_of_each_count(tmp_path, monkeypatch, capsys):
    path, out = tmp_path / "costs.json", tmp_path / "out.json"
    write_cost_model(path, costs())
    runs = iter([[(18, 12, PLAIN_TPOT + gap)] for gap in (0.009, 0.002, 0.005)])  # one request per repeat
    monkeypatch.setattr(serving_cost, "measure", lambda texts, max_tokens, log_dir: next(runs))
    monkeypatch.setattr("backends.engine.model_store.load_prepared", lambda: type("P", (), {"revision": REVISION}))
    assert serving_cost.main(["--costs", str(path), "--out", str(out), "--requests", "1", "--repeats", "3"]) == 0
    assert load_cost_model(out).serving_s == pytest.approx(0.005, abs=1e-9)
    text = capsys.readouterr().out
    assert "| p0 r2 | 18 | 12 |" in text
    assert "serving_s over 3 repeats: 9.00, 2.00, 5.00 ms; kept the median, 5.00 ms" in text

    # per count: each repeat fitted with the smaller counts' kept entries in place, the median repeat kept
    from msgspec import structs

    entries = iter([0.004, 0.001, 0.003, 0.002])  # c2: 4 and 1 ms (keep 1: the lower middle), c4: 3 and 2 (keep 2)
    seen = []

    def fit_concurrent(model, measured, clients):
        seen.append((clients, list(model.serving_streams)))
        return structs.replace(model, serving_streams=[*model.serving_streams, clients],
                               serving_streams_s=[*model.serving_streams_s, next(entries)])

    monkeypatch.setattr(serving_cost, "fit_concurrent", fit_concurrent)
    monkeypatch.setattr(serving_cost, "measure", lambda texts, max_tokens, log_dir, idle=None, clients=1: [
        (18, 12, 0.05)] * 8)
    args = ["--costs", str(path), "--out", str(out), "--concurrency", "2", "4", "--requests", "8", "--repeats", "2"]
    assert serving_cost.main(args) == 0
    assert seen == [(2, []), (2, []), (4, [2]), (4, [2])]
    written = load_cost_model(out)
    assert (written.serving_streams, written.serving_streams_s) == ([2, 4], [0.001, 0.002])
    assert "c2: 4.00, 1.00 ms per stream and round over 2 repeats; kept the median, 1.00 ms" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        serving_cost.main(["--costs", str(path), "--repeats", "0"])
    assert "--requests and --repeats must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serving_cost.main(["--costs", str(path), "--idle-s", "5", "--repeats", "2"])
    assert "leave out --concurrency and --repeats" in capsys.readouterr().err


def test_a_cost_model_of_other_weights_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    from tests.replay.replay_helpers import OTHER

    path = tmp_path / "costs.json"
    write_cost_model(path, costs(revision=OTHER))
    monkeypatch.setattr(serving_cost, "measure", lambda *a: pytest.fail("nothing may start"))
    monkeypatch.setattr("backends.engine.model_store.load_prepared", lambda: type("P", (), {"revision": REVISION}))
    assert serving_cost.main(["--costs", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {path}")


def test_idle_schedule_serves_every_prompt_back_to_back_and_after_idle_alternating_which_first():
    assert serving_cost.idle_schedule(3) == [(0, False), (0, True), (1, True), (1, False), (2, False), (2, True)]


def test_idle_effect_pairs_each_prompts_tpot_and_writes_nothing(tmp_path, monkeypatch, capsys):
    path = tmp_path / "costs.json"
    write_cost_model(path, costs())
    before = path.read_bytes()
    seen = {}

    def measure(texts, max_tokens, log_dir, idle=None):
        seen.update(texts=texts, idle=idle)
        # prompt n's TPOT: 40 ms back-to-back, 44 ms after idle (ratio 1.1); prompt tokens = 100 + n
        return [(100 + int(t[-1]), 12, 0.044 if wait else 0.040) for t, wait in zip(texts, idle)]

    monkeypatch.setattr(serving_cost, "measure", measure)
    monkeypatch.setattr(serving_cost, "prompts", lambda text, count: [f"text {n}" for n in range(count)])
    monkeypatch.setattr("backends.engine.model_store.load_prepared", lambda: type("P", (), {"revision": REVISION}))
    assert serving_cost.main(["--costs", str(path), "--requests", "2", "--idle-s", "3"]) == 0
    assert seen == {"texts": ["text 0", "text 0", "text 1", "text 1"], "idle": [0.0, 3.0, 3.0, 0.0]}
    out = capsys.readouterr().out
    assert "| p0 | 100 | 40.0 | 44.0 | 1.100 | back-to-back |" in out
    assert "| p1 | 101 | 40.0 | 44.0 | 1.100 | after idle |" in out
    assert "geometric mean over 2 prompts: 1.100 [1.100, 1.100]" in out
    assert path.read_bytes() == before
    with pytest.raises(SystemExit):
        serving_cost.main(["--costs", str(path), "--idle-s", "0"])
    assert "--idle-s must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serving_cost.main(["--costs", str(path), "--idle-s", "3", "--concurrency", "2"])
    assert "--idle-s measures one client at a time" in capsys.readouterr().err


def test_concurrency_fits_the_serving_streams_table_count_by_count_on_replays_plain_requests(tmp_path, monkeypatch,
                                                                                          capsys):
    from msgspec import structs

    from replay.choosers import Prices
    from replay.run import parse_arm, sweep

    lengths = [(18, 12), (30, 8), (12, 12), (25, 10), (40, 9), (16, 12), (22, 11), (35, 10)]
    truth = structs.replace(costs(), serving_s=0.003, serving_streams=[2, 4], serving_streams_s=[0.0071, 0.0024])
    # what replay serves at c2 and at c4 with the true table: the "measured" TPOTs, in the clients' order

    def replayed(model, clients: int) -> list[float]:
        book = serving_cost.plain_book(model, lengths)
        load = f"c{clients}"
        served = sweep(Prices(book, model), [parse_arm("plain", book)], [load], 1, "by-slice", max_running=16,
                       max_total_tokens=65536, order=[list(range(len(lengths)))])[("plain", load, 0)]
        return [s.tpot for s in sorted(served, key=lambda s: s.index)]

    measured = {n: [(p, o, t) for (p, o), t in zip(lengths, replayed(truth, n))] for n in (2, 4)}
    assert measured[2] != measured[4]  # the two counts' entries both matter to what is measured
    base = structs.replace(truth, serving_streams=[], serving_streams_s=[])
    fitted = serving_cost.fit_concurrent(base, measured[2], 2)
    assert fitted.serving_streams == [2] and fitted.serving_streams_s == [pytest.approx(0.0071, abs=2e-6)]
    assert structs.replace(fitted, serving_streams=[], serving_streams_s=[]) == base

    path, out = tmp_path / "costs.json", tmp_path / "out.json"
    write_cost_model(path, base)
    calls = []
    monkeypatch.setattr(serving_cost, "measure", lambda texts, max_tokens, log_dir, idle=None, clients=1: (
        calls.append(clients) or measured[clients]))
    monkeypatch.setattr("backends.engine.model_store.load_prepared", lambda: type("P", (), {"revision": REVISION}))
    args = ["--costs", str(path), "--out", str(out), "--concurrency", "4", "2", "--requests", "8"]
    assert serving_cost.main(args) == 0
    assert calls == [2, 4]  # ascending: c4's entry is fitted with c2's in place
    written = load_cost_model(out)
    assert written.serving_streams == [2, 4]
    assert written.serving_streams_s == [pytest.approx(0.0071, abs=2e-6), pytest.approx(0.0024, abs=2e-6)]
    assert written.serving_concurrent_s is None
    assert "serving per stream and round: c2 7.10 ms, c4 2.40 ms (serving_s 3.00 ms at c1)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        serving_cost.main(["--costs", str(path), "--concurrency", "4", "--requests", "7"])
    assert "--requests 7: give at least 2 x the largest --concurrency (8)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serving_cost.main(["--costs", str(path), "--concurrency", "1", "4", "--requests", "8"])
    assert "--concurrency: each N must be >= 2" in capsys.readouterr().err
