"""bench.step_probes on a tiny random model: the mixed forward holds exactly the rounds and the chunk, every
forward is rolled back (the caches keep their lengths), and the idle probe sleeps the gap before each first
forward."""

from __future__ import annotations

import re

import backends.engine.runner as runner_module
from bench.step_probes import Probe, report
from tests.engine.engine_helpers import tiny_llama


def test_the_mixed_forward_holds_the_rounds_and_the_chunk_and_everything_is_rolled_back(monkeypatch):
    runner = runner_module.ModelRunner(tiny_llama(vocab=64, seed=1, layers=1))
    probe = Probe(runner, context=16, chunk_at=32, chunk=24)
    shapes = []
    real = runner.forward_batch

    def spy(feeds):
        shapes.append(sorted((f.cache.length, len(f.tokens)) for f in feeds))
        return real(feeds)

    monkeypatch.setattr(runner, "forward_batch", spy)
    rounds, chunk, both = probe.mixed_step(batch=3, repeats=2)
    assert min(rounds, chunk, both) > 0
    timed = [s for s in shapes if s != [(0, 16)] and s != [(0, 32)]]  # less the caches' own prefills
    # each form: a warm-up and 2 timed forwards, every one from the same cached lengths (rolled back)
    assert timed == [[(16, 1)] * 3] * 3 + [[(32, 24)]] * 3 + [[(16, 1)] * 3 + [(32, 24)]] * 3


def test_the_idle_probe_sleeps_before_each_first_forward_and_the_report_prints_both(capsys):
    runner = runner_module.ModelRunner(tiny_llama(vocab=64, seed=1, layers=1))
    slept = []
    report(Probe(runner, context=16, chunk_at=32, chunk=24), [1], 2, gaps=(0.0, 0.5), sleep=slept.append)
    assert slept == [0.0, 0.0, 0.5, 0.5]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "mixed steps: B one-token rounds at context 16 and a 24-token chunk after 32"
    assert re.fullmatch(r"  B=1: rounds [\d.]+ ms, chunk [\d.]+ ms, sum [\d.]+ ms, one forward holding both [\d.]+ ms "
                        r"\([\d.]+x the sum\)", lines[1])
    assert lines[2] == "a one-token forward at context 16 after an idle gap"
    assert [line.split(":")[0] for line in lines[3:]] == ["  gap 0.00 s", "  gap 0.50 s"]
