"""What a test does when something it needs is not on the machine.

Locally a missing prerequisite skips, with a reason that names what is missing and how to get it. In CI
(``CI=true``, as CI runs `.ci/run`) it fails: a CI run that skipped the real model or the workloads would
pass without checking what those tests claim. tests/README.md lists every skip and what it leaves unchecked.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def missing(reason: str) -> NoReturn:
    """Skip with ``reason``, or fail with it under ``CI=true``."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: a missing prerequisite is a failure, not a skip)", pytrace=False)
    pytest.skip(reason)
