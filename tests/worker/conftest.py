"""The worker app in-process around a tiny random llama (real tokenizer), via Litestar's TestClient.

The HTTP layer, validation, streaming and the asyncio<->engine bridge are all real; only the weights
are tiny so that each request takes milliseconds (greedy output is still exact fp32 decoding).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from litestar.testing import TestClient

from backends.engine.config import EngineConfig
from backends.worker.app import create_app
from backends.worker.settings import WorkerSettings
from tests.engine.engine_helpers import make_tiny_engine


@contextmanager
def running_worker(tokenizer, **settings) -> Iterator[TestClient]:
    settings.setdefault("draft_layers", 1)
    settings.setdefault("calibrate", False)

    def factory(config: EngineConfig):
        return make_tiny_engine(tokenizer, frozen_costs=False, max_running_requests=config.max_running_requests,
                                max_total_tokens=config.max_total_tokens,
                                max_waiting_requests=config.max_waiting_requests,
                                max_batch_tokens=config.max_batch_tokens, prefill_chunk=config.prefill_chunk,
                                default_speculation=config.default_speculation)

    app = create_app(WorkerSettings(**settings), engine_factory=factory)
    with TestClient(app, timeout=30) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "tiny worker did not become healthy in 30 s"
            time.sleep(0.05)
        yield client


@pytest.fixture(scope="module")
def worker(real_tokenizer) -> Iterator[TestClient]:
    """Plain decoding by default, like an SGLang server launched without speculation."""
    with running_worker(real_tokenizer) as client:
        yield client


@pytest.fixture
def worker_factory(real_tokenizer) -> Callable:
    return lambda **settings: running_worker(real_tokenizer, **settings)
