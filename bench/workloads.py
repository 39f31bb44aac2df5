"""Real benchmark prompts: the sample in ``workloads/``, or the full sets that ``--workloads DIR`` or
``$SPECGATE_WORKLOADS`` name. The loader is the product's (``replay/workloads.py``); the product never imports
``bench/``.
"""

from __future__ import annotations

from replay.workloads import (
    GORILLA_TO_OPENAPI, SLICES, WorkItem, bfcl_tools, load_all, sample, truncate_middle,
)
from workloads import default_dir

__all__ = ["DEFAULT_ROOT", "GORILLA_TO_OPENAPI", "SLICES", "WorkItem", "bfcl_tools", "load_all", "sample",
           "truncate_middle"]

# $SPECGATE_WORKLOADS (a full copy of the sets), else the sample shipped in workloads/
DEFAULT_ROOT = default_dir()
