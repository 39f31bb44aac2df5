"""The pair gates' command line without a model: `specgate policy check`'s gates line and its canary file
checks, and `specgate pair check`'s exit codes where no worker answers (docs/policy.md, "Pair gates")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.processes import free_port
from cli import main

REPO = Path(__file__).resolve().parents[2]
DEFAULT_POLICY = REPO / "deploy" / "policies" / "default.yaml"


def _policy(tmp_path: Path, gates: str, worker: str = "http://127.0.0.1:9") -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(f"""version: 1
slices: [{{name: prose}}]
pairs:
  smollm2-ngram:
    target: {{model: SmolLM2-135M-Instruct, revision: "sha256:abc"}}
    draft: {{kind: ngram}}
pools:
  plain: {{proposer: none, workers: ["{worker}"], speculation: per_request}}
  ngram: {{proposer: ngram, draft_tokens: 4, pair: smollm2-ngram, workers: ["{worker}"], speculation: per_request}}
rules: [{{name: rest, then: bypass}}]
{gates}
""", encoding="utf-8")
    return path


def test_policy_check_prints_the_default_policys_gates(capsys):
    assert main(["policy", "check", str(DEFAULT_POLICY)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "  gates: equivalence: 4 canaries (built-in), 32 tokens, sampled check 48 x 4 tokens; serving ramp from " \
           "0.25 per load region; outcome (after 20 reports a side); collapse floor 1.05 over 200 rounds" in out


def test_policy_check_says_when_the_gates_are_off(tmp_path, capsys):
    assert main(["policy", "check", str(_policy(tmp_path, ""))]) == 0
    assert "  gates: off (pools serve once their workers report the declared pair)" in capsys.readouterr().out


def test_policy_check_counts_a_canary_files_canaries(tmp_path, capsys):
    (tmp_path / "canaries.jsonl").write_text(
        '{"id": "a", "slice": "code", "prompt": "def f(): pass"}\n\n'
        '{"id": "b", "slice": "code", "prompt": "def g(): pass"}\n'
        '{"id": "c", "messages": [{"role": "user", "content": "hi"}]}\n', encoding="utf-8")
    policy = _policy(tmp_path, "gates:\n  equivalence: {canaries: canaries.jsonl, sampled: null}\n  serving: null\n"
                               "  outcome: null\n  collapse: null")
    assert main(["policy", "check", str(policy)]) == 0
    # per_slice 1: one of the two code canaries, and the default-slice one
    assert "  gates: equivalence: 2 canaries (canaries.jsonl), 32 tokens" in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize(("lines", "error"), [
    (None, "{canaries}: cannot read the canary file (No such file or directory); fix gates.equivalence.canaries"),
    ('{"id": "a", "prompt": "x"}\n{"id": "b", "promt": "y"}\n',
     '{canaries}:2: Object contains unknown field `promt`; each line is {{"id", "slice", "prompt" or "messages"}}'),
    ('{"id": "a", "prompt": "x"}\nnope\n',
     "{canaries}:2: not JSON (JSON is malformed: invalid character (byte 4)); one JSON object per line"),
    ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n',
     "{canaries}:2: `id` 'a' repeats an earlier line; ids must be unique"),
    ('{"id": "a"}\n', "{canaries}:1: give exactly one of `prompt` or `messages`"),
    ("\n", "{canaries}: no canaries; add at least one line"),
], ids=["missing", "unknown-field", "not-json", "repeated-id", "no-prompt", "empty"])
def test_policy_check_fails_on_an_unusable_canary_file(tmp_path, capsys, lines, error):
    canaries = tmp_path / "canaries.jsonl"
    if lines is not None:
        canaries.write_text(lines, encoding="utf-8")
    policy = _policy(tmp_path, "gates:\n  equivalence: {canaries: canaries.jsonl}")
    assert main(["policy", "check", str(policy)]) == 1
    assert capsys.readouterr().err.splitlines() == [f"{policy}: " + error.format(canaries=canaries)]


def test_pair_check_refuses_a_pool_that_is_not_speculative(tmp_path, capsys):
    policy = _policy(tmp_path, "gates: {}")
    for pool in ("plain", "nope"):
        assert main(["pair", "check", "--policy", str(policy), "--pool", pool]) == 2
        assert capsys.readouterr().err == (f"--pool {pool}: not a speculative pool with a pair in {policy}; "
                                           "choose one of: ngram\n")


def test_pair_check_refuses_an_invalid_policy(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 2\n", encoding="utf-8")
    assert main(["pair", "check", "--policy", str(bad), "--pool", "ngram"]) == 2
    assert "bad.yaml:1:10" in capsys.readouterr().err


def test_pair_check_refuses_an_unusable_canary_file(tmp_path, capsys):
    policy = _policy(tmp_path, "gates:\n  equivalence: {canaries: missing.jsonl}")
    assert main(["pair", "check", "--policy", str(policy), "--pool", "ngram"]) == 2
    assert "missing.jsonl: cannot read the canary file" in capsys.readouterr().err


def test_pair_check_is_an_error_not_a_verdict_when_no_worker_answers(tmp_path, capsys):
    policy = _policy(tmp_path, "gates: {}", worker=f"http://127.0.0.1:{free_port()}")
    assert main(["pair", "check", "--policy", str(policy), "--pool", "ngram"]) == 3
    out = capsys.readouterr().out
    assert out.startswith("pool ngram (pair smollm2-ngram@") and out.endswith(
        "): error: pool 'ngram' has no healthy worker whose pair identity matches the policy\n")


def test_pair_check_prints_the_error_verdict_as_json(tmp_path, capsys):
    policy = _policy(tmp_path, "", worker=f"http://127.0.0.1:{free_port()}")  # no gates: the defaults apply
    assert main(["pair", "check", "--policy", str(policy), "--pool", "ngram", "--json"]) == 3
    verdict = json.loads(capsys.readouterr().out)
    assert (verdict["passed"], verdict["error"], verdict["mismatch"]) == (False, True, None)
    assert verdict["reason"] == "pool 'ngram' has no healthy worker whose pair identity matches the policy"
