"""Every SGLang flag the kit uses exists in SGLang 0.5.23 (list: sglang_server_args.py, from its source)."""

from __future__ import annotations

import pytest

from deploy_files import LAUNCH, compose_sglang_commands, k8s_pool_commands, parse_launch_args
from sglang_server_args import SPECULATIVE_ALGORITHMS, SWITCH_FLAGS, VALUE_FLAGS

COMMANDS = {**{f"k8s:{pool}": argv for pool, argv in k8s_pool_commands().items()},
            **{f"compose:{svc}": argv for svc, argv in compose_sglang_commands().items()}}


def test_the_kit_has_sglang_commands_in_both_kubernetes_and_compose():
    assert sorted(COMMANDS) == ["compose:sglang-eagle3", "compose:sglang-plain", "k8s:eagle3", "k8s:ngram",
                                "k8s:plain", "k8s:standalone"]


@pytest.mark.parametrize("where", sorted(COMMANDS))
def test_every_flag_exists_in_sglang_0_5_23_and_takes_a_value_when_it_should(where):
    argv = COMMANDS[where]
    assert argv[:3] == LAUNCH
    flags = parse_launch_args(argv[3:])
    algorithm = flags.get("--speculative-algorithm")
    assert algorithm is None or algorithm in SPECULATIVE_ALGORITHMS
    for flag in ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--port"):
        if flag in flags:
            assert int(flags[flag]) >= 1, f"{where}: {flag} {flags[flag]}"


def test_the_flag_parser_catches_a_plausible_misspelling_and_a_missing_value():
    with pytest.raises(AssertionError, match="--speculative-draft-tokens is not a server flag"):
        parse_launch_args(["--speculative-draft-tokens", "4"])
    with pytest.raises(AssertionError, match="--revision needs a value"):
        parse_launch_args(["--revision", "--enable-metrics"])


def test_the_flag_list_knows_the_switches_and_value_flags_the_kit_relies_on():
    assert {"--enable-metrics", "--speculative-adaptive"} <= SWITCH_FLAGS
    assert {"--model-path", "--revision", "--weight-version", "--speculative-draft-model-revision",
            "--speculative-num-draft-tokens"} <= VALUE_FLAGS
    assert not SWITCH_FLAGS & VALUE_FLAGS
