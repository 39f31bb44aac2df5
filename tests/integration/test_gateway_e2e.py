"""The gateway as a real process in front of a real `specgate worker` (real model), driven with the
official `openai` client and raw HTTP.

One worker for the module (model load once); gateways are cheap and started per scenario. Token
budgets stay small (8-24): this machine has 2 shared cores.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.integration.gateway_processes import ADMIN_TOKEN, gateway, policy_text, write_policy
from tests.integration.worker_process import worker

pytestmark = [pytest.mark.integration, pytest.mark.real_model]
MODEL = "SmolLM2-135M-Instruct"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n# write mul(a, b) like above\n"
RULES = {"unverified-pair", "code-ngram", "tiny-budget", "learned"}


@pytest.fixture(scope="module")
def worker_url(tmp_path_factory, prepared_model):
    with worker(tmp_path_factory.mktemp("worker"), "--max-running-requests", "4",
                "--num-threads", "1") as url:
        yield url


@pytest.fixture(scope="module")
def revision(prepared_model):
    return prepared_model.revision


@pytest.fixture(scope="module")
def gw(tmp_path_factory, worker_url, revision):
    tmp = tmp_path_factory.mktemp("gw")
    policy = write_policy(tmp / "policy.yaml", policy_text([worker_url], revision=revision))
    with gateway(tmp, policy, "--max-body-bytes", "100000") as url:
        yield url


@pytest.fixture
def client(gw):
    return openai.OpenAI(base_url=f"{gw}/v1", api_key="anything", max_retries=0, timeout=120)


def _decision(headers) -> dict[str, str]:
    return {k: headers[f"x-specgate-{k}"] for k in ("slice", "pool", "rule", "draft-tokens", "overhead-ms")}


def test_non_streaming_chat_carries_the_decision(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12)
    completion = raw.parse()
    d = _decision(raw.headers)
    assert raw.status_code == 200 and completion.choices[0].message.content
    assert completion.usage.completion_tokens <= 12
    assert d["slice"] == "prose" and d["rule"] in RULES and d["pool"] in ("plain", "ngram")
    assert float(d["overhead-ms"]) >= 0
    info = raw.http_response.json()["specgate"]
    assert (info["slice"], info["pool"], info["rule"]) == (d["slice"], d["pool"], d["rule"])
    assert info["draft_tokens"] == int(d["draft-tokens"])
    assert info["verify_rounds"] >= 1 and info["accept_length"] >= 1.0
    assert info["explored"] is ("auto: exploring " in info["reason"])


def test_streaming_chat_ends_with_the_specgate_object(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=16, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason in ("stop", "length")
    info = chunks[-1].model_extra["specgate"]
    assert info["slice"] == "prose" and info["completion_tokens"] >= 1
    assert info["explored"] is ("auto: exploring " in info["reason"])
    assert all("specgate" not in c.model_extra for c in chunks[:-1])


def test_streaming_with_usage_puts_specgate_on_the_usage_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say yes."}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens >= 1
    assert last.model_extra["specgate"]["completion_tokens"] == last.usage.completion_tokens


def test_completions_stream_and_not(client):
    plain = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8)
    assert plain.choices[0].text and plain.model_extra["specgate"]["slice"] == "prose"
    chunks = list(client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].model_extra["specgate"]["pool"] in ("plain", "ngram")


def test_logprobs_pass_through_streamed_and_not(client):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8,
               temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**ask)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 8
    assert b"".join(bytes(t.bytes) for t in content).decode(errors="replace") == whole.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)  # greedy
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-3)
    text = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0, logprobs=1,
                                     extra_body={"ignore_eos": True})
    assert len(text.choices[0].logprobs.tokens) == 6 and len(text.choices[0].logprobs.top_logprobs) == 6
    # how lm-evaluation-harness scores a continuation: echo the prompt with its logprobs, one token more
    scored = client.completions.create(model=MODEL, prompt="The sky is blue", max_tokens=1, temperature=0,
                                       echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == scored.usage.prompt_tokens + 1 and "".join(lp.tokens) == scored.choices[0].text
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])


def _ttft_sum(gw: str) -> float:
    lines = httpx.get(f"{gw}/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("specgate_time_to_first_token_seconds_sum"))


def test_echo_streams_the_prompt_first_and_ttft_waits_for_a_generated_token(gw, client):
    prompt = "The meeting discussed the budget and the schedule. " * 20  # ~200 tokens of prefill after the echo
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text.startswith(prompt) and len(whole.choices[0].text) > len(prompt)
    before = _ttft_sum(gw)
    started, arrivals = time.perf_counter(), []
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                           stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            arrivals.append((time.perf_counter() - started, chunk.choices[0].text))
    assert arrivals[0][1] == prompt and "".join(text for _, text in arrivals) == whole.choices[0].text
    # the gateway's TTFT is the first generated token's, which the client sees after the echoed prompt
    ttft = _ttft_sum(gw) - before
    assert arrivals[0][0] < ttft <= arrivals[1][0]


def test_tools_route_to_the_tool_call_slice(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools, max_tokens=8)
    assert raw.headers["x-specgate-slice"] == "tool_call"


def test_code_is_pinned_to_ngram_by_its_rule(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": CODE}], max_tokens=16)
    d = _decision(raw.headers)
    assert (d["slice"], d["rule"], d["pool"], d["draft-tokens"]) == ("code", "code-ngram", "ngram", "4")
    info = raw.http_response.json()["specgate"]
    assert info["proposer"] == "ngram" and info["verify_rounds"] >= 1


def test_long_prompt_routes_to_long_context(client):
    prompt = "The meeting discussed the budget and the schedule. " * 120  # ~6 KB, ~1700 approx tokens
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4)
    d = _decision(raw.headers)
    assert d["slice"] == "long_context" and d["rule"] == "tiny-budget" and d["draft-tokens"] == "0"


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    (b'{"model": "x", "messages": [', 400, None, "not valid JSON"),
    (b'[1, 2]', 400, None, "must be a JSON object"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokenz": 3}),
     400, "max_tokenz", "unknown field"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "3"}),
     400, "max_tokens", "Expected `int | null`, got `str`"),
    (json.dumps({"model": MODEL, "messages": []}), 400, "messages", "messages is empty"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
     400, "max_tokens", ">= 1"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9000}),
     400, "max_tokens", "context window is 8192"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}), 400,
     "top_logprobs", "needs logprobs: true"),
    (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}), 404, "model",
     "does not exist"),
    (json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}), 400,
     "messages[0].role", "Invalid enum value 'robot'"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 19000}]}), 400,
     "messages", "context window"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 120000}]}), 413, None,
     "over this gateway's limit of 100000 bytes"),
])
def test_bad_input_answers_the_right_status(gw, body, status, param, words):
    r = httpx.post(f"{gw}/v1/chat/completions", content=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == status, error
    assert words in error["message"] and error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}


def test_worker_context_refusal_is_mapped(gw):
    # ~1.3x more tokens than bytes/3.6 estimates: the gateway forwards, the worker's 400 is mapped
    prompt = "{[(<>)]}" * 5000
    r = httpx.post(f"{gw}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_openai_client_raises_its_own_error_classes(client):
    with pytest.raises(openai.BadRequestError, match="messages is empty"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_models_health_ready_openapi_metrics(gw, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{gw}/health").json() == {"status": "ok"}
    assert httpx.get(f"{gw}/ready").status_code == 200
    assert "/v1/chat/completions" in httpx.get(f"{gw}/schema/openapi.json").json()["paths"]
    assert httpx.get(f"{gw}/metrics").status_code == 200


def test_admin_api(gw, client, revision):
    assert httpx.get(f"{gw}/admin/policy").status_code == 401
    assert httpx.get(f"{gw}/admin/policy", headers={"authorization": "Bearer wrong"}).status_code == 401
    status = httpx.get(f"{gw}/admin/policy", headers=ADMIN).json()
    assert status["last_reload"]["ok"] is True and status["pools"] == ["ngram", "plain"]
    pools = httpx.get(f"{gw}/admin/pools", headers=ADMIN).json()
    assert pools["ngram"]["snapshot"]["pair_verified"] is True
    assert pools["ngram"]["workers"][0]["identity"]["target_revision"] == revision
    explained = httpx.post(f"{gw}/admin/explain", headers=ADMIN, json={
        "model": MODEL, "messages": [{"role": "user", "content": CODE}], "max_tokens": 16}).json()
    assert explained["slice"] == "code" and explained["decision"]["rule"] == "code-ngram"
    assert [r["rule"] for r in explained["rules"]] == ["unverified-pair", "code-ngram"]
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CODE}], max_tokens=12)
    time.sleep(0.3)  # the snapshot is rebuilt at most every 100 ms
    stats = httpx.get(f"{gw}/admin/stats", headers=ADMIN).json()
    assert any(key.startswith("*|code|ngram|") for key in stats["acceptance"])


def test_disconnect_mid_stream_aborts_the_worker_request(gw, worker_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{gw}/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            seen = [line for _, line in zip(range(6), lines) if line]
            assert seen and seen[0].startswith("data: ")
            running = httpx.get(f"{worker_url}/v1/loads").json()["loads"][0]["num_running_reqs"]
            assert running == 1
        closed = time.monotonic()  # leaving the block closes the connection mid-stream
    while time.monotonic() - closed < 3:
        if httpx.get(f"{worker_url}/v1/loads").json()["loads"][0]["num_running_reqs"] == 0:
            break
        time.sleep(0.05)
    assert time.monotonic() - closed < 1.5, "the worker still runs the request 1.5 s after the disconnect"



def _load(worker_url: str) -> dict:
    return httpx.get(f"{worker_url}/v1/loads").json()["loads"][0]


def _aborted_count(gw: str) -> float:
    text = httpx.get(f"{gw}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specgate_requests_total{") and 'status="aborted"' in line)


def _disconnect_after_1s(url: str, path: str, body: dict, worker_url: str) -> float:
    """POST a long non-streaming request, give up after ~1 s, return how long after the disconnect
    the worker was back at its idle baseline (no running request, no KV tokens in use)."""
    _wait_idle(worker_url, since=time.monotonic(), what="before the request")  # health probes pass
    try:
        r = httpx.post(f"{url}{path}", json=body, timeout=httpx.Timeout(1.0, connect=5.0))
        raise AssertionError(f"answered within 1 s: {r.status_code} {r.text[:300]}")
    except httpx.ReadTimeout:
        pass
    return _wait_idle(worker_url, since=time.monotonic(), what="after the disconnect")


def _wait_idle(worker_url: str, since: float, what: str) -> float:
    """Seconds from ``since`` until the worker shows no running request and no KV tokens in use."""
    while time.monotonic() - since < 5:
        load = _load(worker_url)
        if (load["num_running_reqs"], load["num_used_tokens"]) == (0, 0):
            return time.monotonic() - since
        time.sleep(0.02)
    raise AssertionError(f"the worker is still busy 5 s {what}: {load}")


LONG_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
             "max_tokens": 200, "ignore_eos": True}


def test_disconnect_before_a_json_answer_aborts_the_worker_request(gw, worker_url):
    before = _aborted_count(gw)
    freed = _disconnect_after_1s(gw, "/v1/chat/completions", LONG_CHAT, worker_url)
    assert freed < 1.5, f"the worker was freed {freed:.2f} s after the disconnect"
    deadline = time.monotonic() + 2
    while _aborted_count(gw) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted_count(gw) == before + 1
    # the gateway is healthy afterwards: the next request is answered normally
    ok = httpx.post(f"{gw}/v1/chat/completions", timeout=60, json={**LONG_CHAT, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", LONG_CHAT),
    ("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}),
    ("/generate", {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}),
])
def test_disconnect_before_a_json_answer_frees_the_worker(worker_url, path, body):
    freed = _disconnect_after_1s(worker_url, path, body, worker_url)
    assert freed < 1.5, f"the worker was freed {freed:.2f} s after the disconnect"

def test_auth_and_rate_limits(tmp_path, worker_url, revision):
    routes = """routes:
  - {name: ide, api_keys_env: TEST_KEYS_IDE, rate_limit: {requests_per_s: 0.2, burst: 1}}
  - {name: batch, api_keys_env: TEST_KEYS_BATCH, max_concurrency: 1}"""
    policy = write_policy(tmp_path / "p.yaml", policy_text([worker_url], revision=revision, routes=routes))
    with gateway(tmp_path, policy, env={"TEST_KEYS_IDE": "key-ide", "TEST_KEYS_BATCH": "k1,k2"}) as url:
        msg = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        r = httpx.post(f"{url}/v1/chat/completions", json=msg)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{url}/v1/chat/completions", json=msg, headers={"authorization": "Bearer nope"})
        assert r.status_code == 401
        ide = {"authorization": "Bearer key-ide"}
        first = httpx.post(f"{url}/v1/chat/completions", json=msg, headers=ide, timeout=60)
        assert first.status_code == 200 and first.headers["x-specgate-route"] == "ide"
        second = httpx.post(f"{url}/v1/chat/completions", json=msg, headers=ide)
        assert second.status_code == 429 and 1 <= int(second.headers["retry-after"]) <= 5
        assert second.json()["error"]["code"] == "request_rate_limit"
        batch = openai.OpenAI(base_url=f"{url}/v1", api_key="k2", max_retries=0)
        stream = batch.chat.completions.create(stream=True, **msg)
        next(iter(stream))  # one request in flight on route batch
        with pytest.raises(openai.RateLimitError, match="max_concurrency 1"):
            batch.chat.completions.create(**msg)
        stream.close()


def _wait(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_policy_reload_via_configmap_symlink_swap(tmp_path, worker_url, revision):
    """Kubernetes swaps ``..data`` to a new directory; an invalid version is kept out and reported."""
    def version_dir(name: str, text: str) -> str:
        (tmp_path / name).mkdir()
        write_policy(tmp_path / name / "policy.yaml", text)
        return name

    def swap(target: str) -> None:
        (tmp_path / "..tmp").symlink_to(target)
        (tmp_path / "..tmp").replace(tmp_path / "..data")

    good = policy_text([worker_url], revision=revision)
    (tmp_path / "..data").symlink_to(version_dir("v1", good))
    (tmp_path / "policy.yaml").symlink_to("..data/policy.yaml")
    msg = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    with gateway(tmp_path, tmp_path / "policy.yaml") as url:
        before = httpx.get(f"{url}/admin/policy", headers=ADMIN).json()["version"]
        swap(version_dir("v2", good.replace("then: {pool: ngram, draft_tokens: 4}", "then: {pool: ngrm}")))
        report = _wait(lambda: (r := httpx.get(f"{url}/admin/policy", headers=ADMIN).json())
                       ["last_reload"]["ok"] is False and r)
        assert report["version"] == before
        assert any("policy.yaml:" in e and "ngrm" in e for e in report["last_reload"]["errors"])
        assert httpx.post(f"{url}/v1/chat/completions", json=msg, timeout=60).status_code == 200
        pinned = good.replace("  - {name: learned, then: auto}",
                              "  - {name: prose-pinned, when: {slice: prose}, then: {pool: ngram, "
                              "draft_tokens: 2}}\n  - {name: learned, then: auto}")
        swap(version_dir("v3", pinned))
        _wait(lambda: httpx.get(f"{url}/admin/policy", headers=ADMIN).json()["last_reload"]["ok"])
        r = httpx.post(f"{url}/v1/chat/completions", json=msg, timeout=60)
        assert (r.headers["x-specgate-rule"], r.headers["x-specgate-draft-tokens"]) == ("prose-pinned", "2")


def test_killed_worker_is_retried_on_another(tmp_path, worker_url, revision):
    with worker(tmp_path, "--num-threads", "1") as doomed:
        policy = write_policy(tmp_path / "p.yaml", policy_text([doomed, worker_url], revision=revision))
        with gateway(tmp_path, policy) as url:
            _kill(doomed)
            msg = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            answers = [httpx.post(f"{url}/v1/chat/completions", json=msg, timeout=60) for _ in range(4)]
            assert [a.status_code for a in answers] == [200] * 4
            assert sum(int(a.headers["x-specgate-retries"]) for a in answers) >= 1
            workers = httpx.get(f"{url}/admin/pools", headers=ADMIN).json()["plain"]["workers"]
            dead = next(w for w in workers if w["url"] == doomed)
            assert dead["last_error"] and "ConnectError" in dead["last_error"]


def _kill(url: str) -> None:
    """kill -9 the process listening on ``url``'s port (the worker this test started)."""
    import os
    import signal

    import psutil

    port = int(url.rsplit(":", 1)[1])
    pid = next(c.pid for c in psutil.net_connections("tcp")
               if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN)
    os.kill(pid, signal.SIGKILL)
    _wait(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)


def test_no_healthy_worker_is_a_503(tmp_path, revision):
    from tests.integration.worker_process import free_port

    policy = write_policy(tmp_path / "p.yaml",
                          policy_text([f"http://127.0.0.1:{free_port()}"], revision=revision))
    with gateway(tmp_path, policy) as url:
        assert httpx.get(f"{url}/ready").status_code == 503
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "no_healthy_worker"
