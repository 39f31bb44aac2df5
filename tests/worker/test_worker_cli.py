"""`specgate worker --help` documents every option; bad settings fail at startup, not per request."""

from __future__ import annotations

import argparse

import pytest
import uvicorn

import backends.worker.app
from backends.engine.types import SpeculationParams, SuffixSettings
from backends.worker.settings import WorkerSettings
from cli import build_parser

EXPECTED = {"--host", "--port", "--model-dir", "--dtype", "--max-running-requests", "--max-total-tokens",
            "--max-queued-requests", "--max-batch-tokens", "--chunked-prefill-size", "--draft-layers", "--speculative-algorithm",
            "--speculative-num-draft-tokens", "--speculative-adaptive", "--speculative-adaptive-strategy",
            "--speculative-num-tokens-per-batch-size", "--served-model-name",
            "--weight-version", "--log-level", "--num-threads", "--no-calibrate",
            "--speculative-ngram-min-match-window-size", "--speculative-ngram-max-match-window-size",
            "--speculative-ngram-match", "--speculative-suffix-max-tree-depth",
            "--speculative-suffix-max-cached-requests", "--speculative-suffix-max-spec-factor",
            "--speculative-suffix-min-token-prob", "--speculative-suffix-max-scopes", "--fault-injection",
            "--fault-mode"}


def _worker_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["worker"]


def test_every_option_is_documented():
    options = {opt: action for action in _worker_parser()._actions for opt in action.option_strings
               if opt.startswith("--") and opt != "--help"}
    assert set(options) == EXPECTED
    assert all(action.help and len(action.help) > 10 for action in options.values())


def test_defaults_match_sglang_conventions():
    args = build_parser().parse_args(["worker"])
    assert (args.host, args.port, args.speculative_algorithm) == ("127.0.0.1", 30000, None)
    args = build_parser().parse_args(["worker", "--speculative-algorithm", "NGRAM",
                                      "--speculative-num-draft-tokens", "6", "--speculative-adaptive"])
    assert (args.speculative_algorithm, args.speculative_num_draft_tokens, args.speculative_adaptive) == (
        "NGRAM", 6, True)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens must be in 1..16, got 0"),
    ({"max_queued_requests": 0}, "max_queued_requests must be >= 1, got 0"),
    ({"max_batch_tokens": 0}, "max_batch_tokens must be >= 1, got 0"),
    ({"chunked_prefill_size": 0}, "chunked_prefill_size must be >= 1, got 0"),
    ({"speculative_algorithm": "EAGLE"},
     "speculative_algorithm must be one of NGRAM, STANDALONE, SUFFIX, HYBRID or None"),
    ({"speculative_algorithm": "HYBRID", "speculative_adaptive": True, "speculative_adaptive_strategy": "sglang"},
     "--speculative-algorithm HYBRID picks its source and k with --speculative-adaptive-strategy beta, got sglang; "
     "use beta or another algorithm"),
    ({"speculative_ngram_min_match_window_size": 0},
     "--speculative-ngram-min-match-window-size must be >= 1, got 0"),
    ({"speculative_ngram_min_match_window_size": 5, "speculative_ngram_max_match_window_size": 4},
     "--speculative-ngram-min-match-window-size 5 is above --speculative-ngram-max-match-window-size 4; "
     "lower the min or raise the max"),
    ({"speculative_ngram_match": "first"}, "--speculative-ngram-match must be one of earliest, latest, got 'first'"),
    ({"speculative_suffix_max_tree_depth": 0}, "--speculative-suffix-max-tree-depth must be >= 1, got 0"),
    ({"speculative_suffix_max_cached_requests": -1}, "--speculative-suffix-max-cached-requests must be >= 1, got -1"),
    ({"speculative_suffix_max_scopes": 0}, "--speculative-suffix-max-scopes must be >= 1, got 0"),
    ({"speculative_suffix_max_spec_factor": 0.0}, "--speculative-suffix-max-spec-factor must be a number > 0, got 0.0"),
    ({"speculative_suffix_max_spec_factor": float("inf")},
     "--speculative-suffix-max-spec-factor must be a number > 0, got inf"),
    ({"speculative_suffix_min_token_prob": 1.5}, "--speculative-suffix-min-token-prob must be in [0, 1], got 1.5"),
    ({"speculative_adaptive_strategy": "eagle"},
     "--speculative-adaptive-strategy must be one of beta, sglang, vllm, got 'eagle'"),
    ({"speculative_adaptive_strategy": "vllm"}, "--speculative-num-tokens-per-batch-size goes with "
     "--speculative-adaptive-strategy vllm, which needs it (e.g. 1-3:8,4-15:4,16-4096:0)"),
    ({"speculative_adaptive_strategy": "vllm", "speculative_num_tokens_per_batch_size": "1-3"},
     "--speculative-num-tokens-per-batch-size: k_by_batch: '1-3' is not LO-HI:K or LO:K"),
])
def test_bad_settings_fail_at_startup(kwargs, message):
    with pytest.raises(ValueError) as exc:
        WorkerSettings(**kwargs)
    assert message in str(exc.value)


def test_default_speculation_follows_the_launch_flags():
    spec = WorkerSettings(speculative_algorithm="STANDALONE", speculative_num_draft_tokens=3,
                          speculative_adaptive=True).default_speculation
    assert (spec.proposer, spec.draft_tokens, spec.adaptive) == ("draft_model", 3, True)
    assert WorkerSettings().default_speculation.proposer == "none"

    spec = WorkerSettings(speculative_algorithm="SUFFIX", speculative_num_draft_tokens=8).default_speculation
    assert (spec.proposer, spec.draft_tokens) == ("suffix", 8)
    spec = WorkerSettings(speculative_algorithm="HYBRID", speculative_num_draft_tokens=16,
                          speculative_adaptive=True).default_speculation
    assert (spec.proposer, spec.draft_tokens, spec.adaptive, spec.strategy) == ("hybrid", 16, True, "beta")

    spec = WorkerSettings(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8, speculative_adaptive=True,
                          speculative_adaptive_strategy="vllm",
                          speculative_num_tokens_per_batch_size="1-3:8,4-15:4,16-4096:0").default_speculation
    assert (spec.adaptive, spec.strategy, spec.k_by_batch) == (True, "vllm", ((1, 8), (4, 4), (16, 0)))


SPEC_FLAGS = ["--speculative-algorithm", "SUFFIX", "--speculative-ngram-min-match-window-size", "2",
              "--speculative-ngram-max-match-window-size", "5", "--speculative-ngram-match", "latest",
              "--speculative-suffix-max-tree-depth", "16", "--speculative-suffix-max-cached-requests", "10",
              "--speculative-suffix-max-spec-factor", "2.5", "--speculative-suffix-min-token-prob", "0.25",
              "--speculative-suffix-max-scopes", "3"]


@pytest.fixture
def started(monkeypatch) -> list[WorkerSettings]:
    """`specgate worker` up to the server start: the WorkerSettings it would serve with."""
    seen: list[WorkerSettings] = []
    monkeypatch.setattr(backends.worker.app, "create_app", lambda settings: seen.append(settings) or object())
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    return seen


def test_flag_defaults_are_the_settings_defaults(started):
    args = build_parser().parse_args(["worker"])
    assert args.func(args) == 0
    assert started == [WorkerSettings()]
    assert WorkerSettings().suffix == SuffixSettings()
    spec = WorkerSettings().default_speculation
    assert (spec.ngram_min, spec.ngram_max, spec.ngram_match) == (1, 12, "earliest")


def test_ngram_and_suffix_flags_reach_the_engine_config(started):
    args = build_parser().parse_args(["worker", *SPEC_FLAGS])
    assert args.func(args) == 0
    settings = started[0]
    assert settings.default_speculation == SpeculationParams(proposer="suffix", draft_tokens=4, ngram_min=2,
                                                             ngram_max=5, ngram_match="latest")
    assert settings.suffix == SuffixSettings(max_tree_depth=16, max_cached_requests=10, max_spec_factor=2.5,
                                             min_token_prob=0.25, max_scopes=3)


def test_engine_config_carries_the_suffix_and_ngram_settings(prepared_model):
    from backends.worker.runtime import WorkerRuntime

    settings = WorkerSettings(speculative_algorithm="NGRAM", speculative_ngram_max_match_window_size=6,
                              speculative_ngram_match="latest", speculative_suffix_max_tree_depth=8)
    config = WorkerRuntime(settings).engine_config
    assert config.default_speculation == SpeculationParams(proposer="ngram", ngram_max=6, ngram_match="latest")
    assert config.suffix == SuffixSettings(max_tree_depth=8)


def test_a_bad_flag_value_is_an_error_naming_the_flag(started, capsys):
    args = build_parser().parse_args(["worker", "--speculative-ngram-min-match-window-size", "13"])
    assert args.func(args) == 2 and started == []
    assert capsys.readouterr().out == ("error: --speculative-ngram-min-match-window-size 13 is above "
                                       "--speculative-ngram-max-match-window-size 12; lower the min or raise "
                                       "the max\n")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--speculative-ngram-match", "first"])
    assert "argument --speculative-ngram-match: invalid choice: 'first'" in capsys.readouterr().err


def test_fault_injection_flags_reach_the_settings_and_are_refused_off_loopback(started, capsys):
    args = build_parser().parse_args(["worker", "--fault-injection", "--fault-mode", "random_draft"])
    assert args.func(args) == 0
    assert (started[0].fault_injection, started[0].fault_mode) == (True, "random_draft")
    args = build_parser().parse_args(["worker", "--fault-injection", "--host", "0.0.0.0"])
    assert args.func(args) == 2 and len(started) == 1
    assert capsys.readouterr().out == ("error: --fault-injection is a test switch and needs a loopback --host "
                                       "(127.0.0.1, ::1 or localhost), got --host 0.0.0.0\n")
    args = build_parser().parse_args(["worker", "--fault-mode", "lossy_accept"])
    assert args.func(args) == 2 and len(started) == 1
    assert capsys.readouterr().out == ("error: --fault-mode lossy_accept needs --fault-injection (a test switch; "
                                       "without it the worker never injects faults)\n")
    help_text = " ".join(_worker_parser().format_help().split())  # whatever the terminal width
    assert "TESTS ONLY" in help_text and "loopback" in help_text
