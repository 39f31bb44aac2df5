"""Tests here point structlog at their own buffers; put the process-wide configuration back after each,
so a later test's log line never goes to a closed buffer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()
