"""`specgate worker --help` documents every option; bad settings fail at startup, not per request."""

from __future__ import annotations

import argparse

import pytest

from backends.worker.settings import WorkerSettings
from gateway.cli import build_parser

EXPECTED = {"--host", "--port", "--model-dir", "--dtype", "--max-running-requests", "--max-total-tokens",
            "--max-queued-requests", "--draft-layers", "--speculative-algorithm",
            "--speculative-num-draft-tokens", "--speculative-adaptive", "--served-model-name",
            "--weight-version", "--log-level", "--num-threads", "--no-calibrate"}


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
    ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm must be one of NGRAM, STANDALONE or None"),
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
