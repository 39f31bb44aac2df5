"""A small sample of the public benchmark prompts specgate tests and benchmarks on (README.md beside this file).

``SAMPLE_DIR`` is the default of every ``--workloads`` option and of the tests; ``$SPECGATE_WORKLOADS`` or
``--workloads DIR`` point at a full copy of the sets instead (same layout, see ``replay/workloads.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

SAMPLE_DIR = Path(__file__).resolve().parent


def default_dir() -> Path:
    """``$SPECGATE_WORKLOADS`` when set (a full copy of the sets), else the sample shipped here."""
    return Path(os.environ.get("SPECGATE_WORKLOADS") or SAMPLE_DIR)
