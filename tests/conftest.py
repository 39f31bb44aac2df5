"""Shared fixtures: the real SmolLM2 engine (loaded once per session) and tiny random engines.

The tiny engines use a randomly initialised LlamaForCausalLM of the real architecture family (seeded),
so engine logic is exercised for real in milliseconds; the real model is used where the issue asks for
it (greedy identity, distribution on the real model, bf16). Real-model tests carry
``@pytest.mark.real_model``.
"""

from __future__ import annotations

import signal

import pytest

from tests.engine.engine_helpers import make_tiny_engine
from tests.prerequisites import missing
from tests.valkey_helpers import valkey  # noqa: F401  (the fixture: a real valkey-server on a free port)


@pytest.fixture(autouse=True)
def _sigterm_handler_kept():
    """Every test leaves SIGTERM's handler as it found it. A CLI run in-process that left its own (SIGTERM
    raising KeyboardInterrupt) was inherited by a later test's forked replay workers, and that test's pool
    waited on one of them until the 600 s timeout (a CI failure)."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    after = signal.getsignal(signal.SIGTERM)
    if after is not before:
        signal.signal(signal.SIGTERM, before)
        pytest.fail(f"the test left SIGTERM's handler set to {after!r}; restore the caller's handler when done")


@pytest.fixture(scope="session")
def prepared_model():
    from backends.engine.model_store import ModelNotPrepared, load_prepared

    try:
        return load_prepared()
    except ModelNotPrepared as exc:  # `make test` prepares it; a bare pytest run may not have
        missing(f"real model not prepared ({exc}); run `make setup`")


@pytest.fixture(scope="session")
def real_tokenizer(prepared_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(prepared_model.path), local_files_only=True)


@pytest.fixture(scope="session")
def real_model(prepared_model):
    """The real SmolLM2-135M-Instruct engine (fp32), stepped synchronously by tests."""
    from backends.engine.config import EngineConfig
    from backends.engine.engine import Engine

    engine = Engine(EngineConfig(model_path=str(prepared_model.path), calibrate=False))
    yield engine
    engine.shutdown()


@pytest.fixture
def replay_files(tmp_path):
    """The replay tests' synthetic trace and cost model on disk (tests/replay/replay_helpers.py): (trace, costs)."""
    from tests.replay.replay_helpers import write_files  # policies' trace and cost model: only tests that use it

    return write_files(tmp_path)


@pytest.fixture
def tiny_engine(real_tokenizer):
    """A fresh engine around a tiny random model with the real tokenizer (vocab 49152)."""
    return make_tiny_engine(real_tokenizer)


@pytest.fixture(scope="session")
def cluster_workers(tmp_path_factory, prepared_model):
    """Two real workers (bench/reliability/cluster.py) shared by the reliability and resume tests: the model
    loads once per worker. A test that kills one restarts it on its port before it ends."""
    from bench.reliability.cluster import Workers

    workers = Workers(tmp_path_factory.mktemp("cluster-workers"))
    try:
        workers.start()
        yield workers
    finally:
        workers.close()
