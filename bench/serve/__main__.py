"""``python -m bench.serve``: the serving benchmark (same flags as ``specgate bench serve``)."""

from __future__ import annotations

import sys

from bench.serve.cli import main

sys.exit(main())
