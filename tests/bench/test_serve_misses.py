"""`specgate bench serve --misses` (bench/serve/misses.py): SLO misses by cause, and TTFT misses with another
prompt of the cell waiting alongside; on
synthetic requests and on the kept c4 run (docs/runs/onednn/confirm26) whose goodput gap
docs/runs/2026-12-05-issue26-onednn/README.md explains with it."""

from __future__ import annotations

from pathlib import Path

from bench.serve.cli import main
from bench.serve.misses import misses

RUN = Path(__file__).resolve().parents[2] / "docs/runs/onednn/confirm26/serve-c4-mixed/serve.json.gz"
SLO = {"ttft_ms": 2000.0, "tpot_ms": 150.0}


def served(start: float, ttft: float, tpot: float, *, arm: str = "a", slice_: str = "prose", rep: int = 0,
           ok: bool = True) -> dict:
    return {"arm": arm, "load": "c4", "slice": "mixed", "workload_slice": slice_, "rep": rep, "ok": ok,
            "start_s": start, "ttft_s": ttft, "tpot_s": tpot}


def test_each_miss_is_counted_once_by_its_cause_and_overlapping_waits_are_alongside():
    requests = [
        served(0.0, 2.5, 0.100, slice_="long_context"),  # late; b waits from 1.0 to 3.0: alongside
        served(1.0, 2.0, 0.160, slice_="long_context"),  # TTFT on the bound (met), TPOT over: a TPOT miss
        served(5.0, 2.1, 0.200),  # late and slow: both; nobody else waits 5.0-7.1
        served(8.0, 0.3, 0.050),  # met
        served(0.5, 2.2, 0.100, rep=1),  # late, alone in its repeat (the others are rep 0)
        served(0.0, 9.0, 0.300, ok=False),  # failed: not a request of the table, not a wait either
        served(0.0, 3.0, 0.100, arm="b"),  # another arm's wait does not count as alongside
    ]
    table = misses(requests, SLO)
    assert table[("a", "c4", "long_context")] == {"requests": 2, "ttft": 1, "tpot": 1, "both": 0, "alongside": 1}
    assert table[("a", "c4", "prose")] == {"requests": 3, "ttft": 1, "tpot": 0, "both": 1, "alongside": 0}
    assert table[("b", "c4", "prose")] == {"requests": 1, "ttft": 1, "tpot": 0, "both": 0, "alongside": 0}
    no_ttft = misses(requests, {"ttft_ms": None, "tpot_ms": 150.0})  # a TPOT-only SLO: no TTFT misses at all
    assert no_ttft[("a", "c4", "prose")] == {"requests": 3, "ttft": 0, "tpot": 1, "both": 0, "alongside": 0}


def test_the_kept_c4_run_splits_its_goodput_gap_into_ttft_and_tpot_misses(capsys):
    assert main(["--misses", str(RUN), "--arms", "plain", "ngram-k4", "ngram-k16-beta", "adaptive-warm"]) == 0
    out = capsys.readouterr().out
    # | arm | load | slice | requests | met | TTFT only | TPOT only | both | TTFT misses alongside |
    for row in ("| plain | c4 | all | 80 | 62 | 17 | 1 | 0 | 9 |",
                "| ngram-k4 | c4 | all | 80 | 61 | 12 | 7 | 0 | 11 |",
                "| ngram-k4 | c4 | long_context | 16 | 8 | 8 | 0 | 0 | 7 |",
                "| ngram-k16-beta | c4 | all | 80 | 51 | 18 | 10 | 1 | 15 |",
                "| adaptive-warm | c4 | all | 80 | 50 | 21 | 9 | 0 | 18 |",
                "| adaptive-warm | c4 | long_context | 16 | 0 | 16 | 0 | 0 | 14 |"):
        assert row in out, row
    assert main(["--misses", str(RUN), "--arms", "eagle"]) == 2
    assert "--arms 'eagle' is not in the run" in capsys.readouterr().err
