"""bench.replay_adaptive, the script behind the per-round draft length's replayed figures, on a four-request trace."""

from __future__ import annotations

import re

from bench.replay_adaptive import main
from tests.replay.replay_helpers import PINNED


def test_a_policy_with_nothing_to_learn_costs_nothing_to_learn(replay_files, tmp_path, capsys):
    """PINNED always serves code by n-gram k4 and prose plain: at c1 a request's TPOT is the same in every pass,
    so both cost-of-learning readings (the warm-up pass over the measured one; the three-pass run:
    learning and after one pass, over warm) are exactly 1."""
    trace, costs = replay_files
    policy = tmp_path / "pinned.yaml"
    policy.write_text(PINNED)
    code = main(["--trace", str(trace), "--costs", str(costs), "--loads", "c1", "c2", "--seeds", "2", "--ks", "4",
                 "--processes", "1", "--learning-seeds", "2", "--policy", str(policy)])
    out = capsys.readouterr().out
    assert code == 0
    assert "- policy:pinned c1: warm-up pass over measured pass 1.000 [1.000, 1.000]" in out
    table = out.split("## The issue's reading")[1]
    rows = re.findall(r"^\| policy:pinned \| (c\d) \| (.+) \| (.+) \|$", table, re.M)
    assert [load for load, _, _ in rows] == ["c1", "c2"]
    assert rows[0][1:] == ("1.000 [1.000, 1.000]", "1.000 [1.000, 1.000]")


def test_warm_policy_serves_each_pass_whole_in_its_own_order_and_the_measured_one_in_the_arms_order(
        replay_files, tmp_path):
    from bench.replay_adaptive import warm_policy
    from replay.book import RoundBook
    from replay.choosers import Prices
    from replay.run import blocks, load_policy
    from policies.costmodel import load_cost_model
    from policies.trace import read_trace

    trace, costs = replay_files
    policy = tmp_path / "pinned.yaml"
    policy.write_text(PINNED)
    book = RoundBook(read_trace(trace))
    prices = Prices(book, load_cost_model(costs))
    passes = warm_policy(prices, load_policy(policy), "c1", 3, max_running=16, warmups=2)
    expected = [blocks(book, "interleaved", 3 + 10_000)[0], blocks(book, "interleaved", 3 + 20_000)[0],
                blocks(book, "interleaved", 3)[0]]
    assert [[s.index for s in sorted(p, key=lambda s: s.arrival)] for p in passes] == expected
    first, last = passes[0], passes[-1]
    assert max(s.arrival + s.e2e for s in first) <= min(s.arrival for s in last)  # one after the other
