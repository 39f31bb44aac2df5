"""Engine-test settings: torch runs single-threaded in every engine test.

On a 2-core machine a real-model decode forward is as fast with 1 thread as with 2 when the machine is
idle, but with 2 threads it slows several-fold when other processes share the cores, because the OpenMP
threads wait on each other. One thread is as fast when idle and robust when busy.
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
