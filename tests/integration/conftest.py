"""Fixtures of the gateway integration tests: one real `specgate worker` (real model, loaded once for the
package) and one gateway in front of it; scenarios that need their own gateway or worker start them."""

from __future__ import annotations

import openai
import pytest

from bench.processes import gateway, worker, write_policy
from tests.integration.gateway_processes import policy_text


@pytest.fixture(scope="package")
def worker_url(tmp_path_factory, prepared_model):
    with worker(tmp_path_factory.mktemp("worker"), "--max-running-requests", "4",
                "--num-threads", "1") as url:
        yield url


@pytest.fixture(scope="package")
def revision(prepared_model):
    return prepared_model.revision


@pytest.fixture(scope="package")
def gw(tmp_path_factory, worker_url, revision):
    tmp = tmp_path_factory.mktemp("gw")
    policy = write_policy(tmp / "policy.yaml", policy_text([worker_url], revision=revision))
    with gateway(tmp, policy, "--max-body-bytes", "100000") as url:
        yield url


@pytest.fixture
def client(gw):
    return openai.OpenAI(base_url=f"{gw}/v1", api_key="anything", max_retries=0, timeout=120)
