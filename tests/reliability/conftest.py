"""The reliability tests' fixtures; their two real workers are ``cluster_workers`` (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def revision(prepared_model):
    return prepared_model.revision
