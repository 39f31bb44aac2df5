"""Real benchmark prompts from ``../shared/workloads`` (a path argument; never copied here).

The loader is the product's (``gateway/workloads.py``: ``specgate trace build --workloads DIR`` reads the same
format, and the product never imports ``bench/``); the benchmarks add its default location.
"""

from __future__ import annotations

import os
from pathlib import Path

from gateway.workloads import (
    GORILLA_TO_OPENAPI, SLICES, WorkItem, bfcl_tools, load_all, sample, truncate_middle,
)

__all__ = ["DEFAULT_ROOT", "GORILLA_TO_OPENAPI", "SLICES", "WorkItem", "bfcl_tools", "load_all", "sample",
           "truncate_middle"]

# $SPECGATE_WORKLOADS, else the shared/ folder beside the repository (read in place, never copied)
DEFAULT_ROOT = Path(os.environ.get("SPECGATE_WORKLOADS") or Path(__file__).resolve().parents[2] / "shared" / "workloads")
