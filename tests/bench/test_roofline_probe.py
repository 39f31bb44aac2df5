"""bench.roofline --probes: the runner's GEMM-form probe repeated, each probe's ratios and the line it chooses."""

from __future__ import annotations

import re

import backends.engine.runner as runner_module
from bench.roofline import probe_report
from tests.engine.engine_helpers import tiny_llama


def test_each_probe_prints_its_ratios_and_the_line_the_rule_chooses(monkeypatch, capsys):
    runner = runner_module.ModelRunner(tiny_llama(vocab=64, seed=1, layers=1), wide_rows=16)
    # scripted medians: the transposed form wins from 16 rows, then a probe where it loses at 256
    probes = iter([{8: (1.0, 4.0), 16: (1.0, 0.8), 256: (1.0, 1.02)},
                   {8: (1.0, 4.0), 16: (1.0, 0.8), 256: (1.0, 1.2)}])
    monkeypatch.setattr("bench.roofline.probe_gemm_forms", lambda layer: next(probes))
    assert probe_report(runner, 2) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"torch .*; at load: from 16 rows$", lines[0])
    assert lines[1:] == ["probe 1: transposed / x @ W  8: 4.00  16: 0.80  256: 1.02  -> from 16 rows",
                         "probe 2: transposed / x @ W  8: 4.00  16: 0.80  256: 1.20  -> never"]


def test_the_probe_times_every_probed_row_count_in_both_forms():
    runner = runner_module.ModelRunner(tiny_llama(vocab=64, seed=1, layers=1), wide_rows=16)
    medians = runner_module.probe_gemm_forms(runner._layers[0], repeats=1)
    assert sorted(medians) == list(runner_module.PROBE_ROWS)
    assert all(plain > 0 and wide > 0 for plain, wide in medians.values())
