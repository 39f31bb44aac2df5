"""Engine-test settings: tiny-model tests run torch single-threaded.

A 64-wide model spends its time in thread hand-offs when two threads share a busy 2-core machine
(measured: 3.6 ms per forward with 1 thread vs 32 ms with 2 under load). Real-model tests keep
torch's default thread count.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread_for_tiny_models(request):
    if request.node.get_closest_marker("real_model") is not None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
