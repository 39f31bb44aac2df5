"""Two real workers shared by every reliability test (the model loads once per worker)."""

from __future__ import annotations

import pytest

from bench.reliability.cluster import Workers


@pytest.fixture(scope="session")
def cluster_workers(tmp_path_factory, prepared_model):
    workers = Workers(tmp_path_factory.mktemp("reliability-workers"))
    try:
        workers.start()
        yield workers
    finally:
        workers.close()


@pytest.fixture(scope="session")
def revision(prepared_model):
    return prepared_model.revision
