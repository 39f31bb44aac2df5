"""bench.replay_speed on the synthetic trace of test_replay_cli: N requests made from the trace's, every
contender's sweep counted, the policy contender named by its file and left out with --policy none."""

from __future__ import annotations

import re

from bench import replay_speed
from policies.costmodel import write_cost_model
from policies.trace import FORMAT, Header, write_trace
from tests.replay.replay_helpers import PINNED, REQUESTS, REVISION, costs


def files(tmp_path):
    trace, cost_file, policy = tmp_path / "t.jsonl", tmp_path / "costs.json", tmp_path / "pinned.yaml"
    write_trace(trace, Header(format=FORMAT, model="m", revision=REVISION, tokenizer="t"), REQUESTS)
    write_cost_model(cost_file, costs())
    policy.write_text(PINNED)
    return trace, cost_file, policy


def test_arms_and_a_policy_each_timed_over_every_simulated_request(tmp_path, capsys):
    trace, cost_file, policy = files(tmp_path)
    assert replay_speed.main(["--trace", str(trace), "--costs", str(cost_file), "--requests", "10", "--seeds", "2",
                              "--loads", "c1", "c4", "--arms", "plain", "ngram-k4", "--policy", str(policy),
                              "--processes", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    # 10 requests x 2 loads x 2 seeds per contender (plain and ngram-k4 in an interleaved mix vary by seed)
    assert out[0] == "10 requests x 3 contenders x 2 loads x 2 seeds (120 simulated requests, 1 processes)"
    assert [re.match(r"  (\S+): [\d.]+ s \([\d.]+ us per simulated request\)$", line)[1] for line in out[1:4]] == [
        "plain", "ngram-k4", "pinned"]
    assert re.match(r"write \+ read the trace: [\d.]+ \+ [\d.]+ s; rounds and simulation: [\d.]+ s; total", out[4])


def test_policy_none_times_the_arms_alone(tmp_path, capsys):
    trace, cost_file, _ = files(tmp_path)
    assert replay_speed.main(["--trace", str(trace), "--costs", str(cost_file), "--requests", "4", "--seeds", "1",
                              "--loads", "c1", "--arms", "plain", "--policy", "none", "--processes", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "4 requests x 1 contenders x 1 loads x 1 seeds (4 simulated requests, 1 processes)"
    assert len(out) == 3
