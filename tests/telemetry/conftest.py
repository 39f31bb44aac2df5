"""Tests here point structlog at their own buffers; put the process-wide configuration back after each,
so a later test's log line never goes to a closed buffer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from policies.load import load_policy_file
from telemetry.logs import configure_logging
from gateway.telemetry_views import policy_view

POLICY = Path(__file__).with_name("policy.yaml")


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


@pytest.fixture
def quiet_logs(tmp_path) -> Iterator[None]:
    """Log lines to a file in the test's folder, not the terminal."""
    with open(tmp_path / "log.txt", "w") as sink:
        configure_logging(json=True, stream=sink)
        yield


@pytest.fixture
def policy():
    """The telemetry tests' policy (policy.yaml beside them), as telemetry sees it."""
    return policy_view(load_policy_file(POLICY))
