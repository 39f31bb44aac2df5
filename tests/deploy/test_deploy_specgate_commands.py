"""Every `specgate ...` command line in the kit parses with the real CLI (no typo'd flag reaches a pod)."""

from __future__ import annotations

import pytest

from deploy_files import compose_services, find, k8s_objects
from cli import build_parser


def _commands() -> dict[str, list[str]]:
    commands = {f"compose-cpu:{svc}": spec["command"] for svc, spec in compose_services("cpu").items()
                if spec["image"].startswith("specgate:")}  # not the collector
    commands["compose-gpu:gateway"] = compose_services("gpu")["gateway"]["command"]
    gateway = find(k8s_objects(), "Deployment", "specgate-gateway")
    commands["k8s:gateway"] = gateway["spec"]["template"]["spec"]["containers"][0]["args"]
    return commands


COMMANDS = _commands()


@pytest.mark.parametrize("where", sorted(COMMANDS))
def test_command_parses_with_the_specgate_cli(where):
    argv = COMMANDS[where]
    args = build_parser().parse_args(argv)
    assert args.command == argv[0]
    assert str(args.port) == argv[argv.index("--port") + 1]
    assert args.host == argv[argv.index("--host") + 1]
