"""bench.gemm_processes: one fresh child per form and round, alternating, and the spread over processes."""

from __future__ import annotations

import json
import subprocess

import pytest

from bench import gemm_processes


def test_children_alternate_and_the_summary_gives_ranges_and_in_process_ratios(monkeypatch, capsys):
    scripted = {  # seconds per width, per child in the order they run
        "onednn": iter([{1: 0.030, 5: 0.029}, {1: 0.036, 5: 0.034}]),
        "mkl": iter([{1: 0.037, 5: 0.066}, {1: 0.040, 5: 0.094}]),
    }
    calls = []

    def run(argv, **kwargs):
        gemm = argv[argv.index("--child") + 1]
        calls.append(gemm)
        assert argv[argv.index("--widths") + 1:] == ["1", "5"] and kwargs["check"] is True
        return subprocess.CompletedProcess(argv, 0, stdout="log line\n" + json.dumps(next(scripted[gemm])) + "\n")

    monkeypatch.setattr(gemm_processes.subprocess, "run", run)
    assert gemm_processes.main(["--processes", "2", "--widths", "1", "5"]) == 0
    assert calls == ["onednn", "mkl", "mkl", "onednn"]  # ABBA: drift falls on both forms
    out = capsys.readouterr().out.splitlines()
    assert out[-6:] == [
        "forward ms at context 256, range over 2 processes (max / min):",
        "  onednn: 1 tokens 30.0-36.0 (1.20), 5 tokens 29.0-34.0 (1.17)",
        "  mkl: 1 tokens 37.0-40.0 (1.08), 5 tokens 66.0-94.0 (1.42)",
        "each width's time / 1 token(s)' in the same process, range over processes (what a cost model's shape "
        "carries; drift of the whole machine cancels):",
        "  onednn: 5 tokens 0.94-0.97",
        "  mkl: 5 tokens 1.78-2.35",
    ]


def test_bad_counts_are_refused():
    with pytest.raises(SystemExit):
        gemm_processes.main(["--processes", "0"])
