"""Fuzzing: schemathesis over the gateway's OpenAPI schema, Hypothesis bodies for chat and
completions through the gateway, and for the worker's ``/generate``. Zero 5xx; every 4xx (and every
mid-stream error event) in the OpenAI error shape. Token budgets are capped (max_tokens <= 3 when
the body is valid) so a valid case costs a few model steps."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.processes import ADMIN_TOKEN, gateway, write_policy
from bench.reliability.cluster import MODEL, policy_yaml

pytestmark = [pytest.mark.integration, pytest.mark.real_model, pytest.mark.timeout(300)]
EXAMPLES = int(os.environ.get("SPECGATE_FUZZ_EXAMPLES", "40"))  # the full run sets more
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 3), st.integers(2**31, 2**63),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
ANY = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) |
                   st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
BUDGET = st.integers(-2, 3) | st.integers(2**31, 2**63) | st.text(max_size=4) | st.floats()
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | ANY,
     "content": st.text(max_size=30) | ANY},
    optional={"name": ANY, "tool_calls": ANY, "extra": ANY})
COMMON = {"temperature": st.floats(-1, 3) | ANY, "top_p": ANY, "stop": st.text(max_size=5) | ANY,
          "stream": st.booleans() | ANY, "n": ANY, "seed": ANY, "logprobs": ANY, "user": ANY,
          "stream_options": ANY, "unknown_field": ANY}
CHAT = st.fixed_dictionaries({"model": st.just(MODEL) | ANY, "max_tokens": BUDGET,
                              "messages": st.lists(MESSAGE, max_size=3) | ANY},
                             optional={**COMMON, "tools": ANY, "response_format": ANY})
COMPLETION = st.fixed_dictionaries({"model": st.just(MODEL) | ANY, "max_tokens": BUDGET,
                                    "prompt": st.text(max_size=30) | ANY}, optional=COMMON)
GENERATE = st.fixed_dictionaries(
    {"text": st.text(max_size=30) | ANY,
     "sampling_params": st.fixed_dictionaries({"max_new_tokens": BUDGET}, optional={
         "temperature": ANY, "stop": ANY, "top_k": ANY, "custom_params": ANY, "ignore_eos": ANY})},
    optional={"stream": st.booleans() | ANY, "rid": ANY, "input_ids": ANY, "return_logprob": ANY})


def _encode(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN/Infinity: invalid JSON, must be a 400


def assert_openai_answer(r: httpx.Response) -> None:
    """No 5xx; a 4xx is ``{"error": {message, type, ...}}``; a 200 stream's error events too."""
    assert r.status_code < 500, r.text[:300]
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines and lines[-1] == "[DONE]", r.text[-300:]
        for data in lines[:-1]:
            obj = json.loads(data)
            assert "error" not in obj or {"message", "type"} <= set(obj["error"])


@pytest.fixture(scope="module")
def gw(tmp_path_factory, cluster_workers, revision):
    tmp = tmp_path_factory.mktemp("fuzz")
    urls = cluster_workers.urls
    policy = write_policy(tmp / "policy.yaml", policy_yaml(plain=urls, ngram=urls, revision=revision))
    with gateway(tmp, policy, "--max-body-bytes", "20000") as url:
        yield url


def test_schemathesis_over_the_gateway_openapi_schema(gw):
    schema = schemathesis.openapi.from_url(f"{gw}/schema/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/admin/policy"}
    cases = 0
    with httpx.Client(timeout=60) as http:
        for op in operations:
            @given(case=op.as_strategy())
            @settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
            def run(case):
                nonlocal cases
                cases += 1
                headers = {"authorization": f"Bearer {ADMIN_TOKEN}"} if op.path.startswith("/admin") else {}
                kwargs = case.as_transport_kwargs(base_url=gw, headers=headers)
                r = http.request(kwargs["method"], kwargs["url"], headers=kwargs.get("headers"),
                                 params=kwargs.get("params"), content=_body_bytes(kwargs))
                if op.path.startswith("/v1/") and op.method.upper() == "POST" or r.status_code >= 400:
                    assert_openai_answer(r)
                assert r.status_code < 500
            run()
    print(f"schemathesis: {cases} cases over {len(operations)} operations")
    assert cases >= len(operations)


def _body_bytes(kwargs: dict) -> bytes | None:
    if "json" in kwargs:
        return _encode(kwargs["json"])
    return kwargs.get("data") or kwargs.get("content")


@pytest.mark.parametrize(("path", "strategy"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_hypothesis_bodies_through_the_gateway(gw, path, strategy):
    with httpx.Client(timeout=60) as http:
        @FUZZ
        @given(body=strategy | st.binary(max_size=40))
        def run(body):
            content = body if isinstance(body, bytes) else _encode(body)
            assert_openai_answer(http.post(f"{gw}{path}", content=content,
                                           headers={"content-type": "application/json"}))
        run()


def test_hypothesis_bodies_against_worker_generate(cluster_workers):
    worker = cluster_workers.urls[0]
    with httpx.Client(timeout=60) as http:
        @FUZZ
        @given(body=GENERATE | st.binary(max_size=40))
        def run(body):
            content = body if isinstance(body, bytes) else _encode(body)
            r = http.post(f"{worker}/generate", content=content, headers={"content-type": "application/json"})
            assert r.status_code < 500, r.text[:300]
            if r.status_code >= 400:
                assert isinstance(r.json()["error"]["message"], str)
        run()
