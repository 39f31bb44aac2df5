"""Engine-test settings: torch runs single-threaded in every engine test.

Measured here: one real-model decode forward takes 57 ms with 1 thread and 58 ms with 2 on an idle
2-core machine, but with 2 threads it slows by up to 10x (tiny model: 3.6 ms vs 32 ms) when other
processes share the cores, because the OpenMP threads wait on each other. One thread is as fast when
idle and robust when busy.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread_torch():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
