"""The sizes of `specgate bench serve --preset NAME`."""

from __future__ import annotations

# Sizes per preset; every one is also a flag, and a flag given explicitly wins.
PRESETS: dict[str, dict] = {
    # ~36-40 min on a quiet 2-core machine (measured: see docs/benchmarks.md)
    "default": {"per_slice": 4, "max_tokens": 32, "loads": ["c1", "c4", "p1"], "warmup_per_slice": 40},
    # every arm and load, 16 requests per slice (c16 needs 16 per slice to keep 16 in flight). One load
    # point (--loads c1, with its own warm-up) must fit one sitting on a quiet 2-core machine: 2.2 h at 64
    # tokens (c1 part, 0c93c07; docs/runs/full/c1); 128 tokens took longer than a sitting
    "full": {"per_slice": 16, "max_tokens": 64, "loads": ["c1", "c4", "c16", "p0.25", "p0.5", "p1"],
             "warmup_per_slice": 40},
}
