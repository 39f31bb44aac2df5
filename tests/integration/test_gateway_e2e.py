"""The gateway as a real process in front of a real `specgate worker` (real model), driven with the
official `openai` client and raw HTTP: the API surface (decisions, streaming, completions, logprobs, echo,
slices, bad input, admin). Failure handling is in test_gateway_failures.py; fixtures in conftest.py.

Token budgets stay small (8-24): this machine has 2 shared cores.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from bench.processes import ADMIN, MODEL
from tests.integration.gateway_processes import CODE

pytestmark = [pytest.mark.integration, pytest.mark.real_model]
RULES = {"unverified-pair", "code-ngram", "tiny-budget", "learned"}


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
    # SGLang's accept length: the tokens committed over the verify rounds (each round's bonus token included);
    # plain decoding commits one token a round
    assert info["completion_tokens"] == completion.usage.completion_tokens and info["verify_rounds"] >= 1
    assert info["accept_length"] == pytest.approx(info["completion_tokens"] / info["verify_rounds"])
    if info["draft_tokens"] == 0:
        assert (info["verify_rounds"], info["accept_length"]) == (info["completion_tokens"], 1.0)
    assert info["explored"] is ("auto: exploring " in info["reason"])
    # auto (rule learned) weighed plain and the ngram pool's draft lengths; a pinned or bypass rule weighed none
    posterior = info["posterior_tpot_ms"]
    if info["rule"] == "learned":
        assert "plain decoding" in posterior and any(o.startswith("ngram k=") for o in posterior)
        assert all(ms > 0 for ms in posterior.values())
    else:
        assert posterior is None


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
    error = r.json()["error"]
    assert r.status_code == 400 and (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert "context window" in error["message"]


def test_openai_client_raises_its_own_error_classes(client):
    with pytest.raises(openai.BadRequestError, match="messages is empty"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_models_health_ready_openapi_metrics(gw, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{gw}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{gw}/ready")
    assert ready.status_code == 200 and ready.json() == {"ready": True, "healthy_workers": {"ngram": 1, "plain": 1}}
    assert "/v1/chat/completions" in httpx.get(f"{gw}/schema/openapi.json").json()["paths"]
    metrics = httpx.get(f"{gw}/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "# TYPE specgate_requests_total counter" in metrics.text


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

    def learned() -> bool:  # the snapshot is rebuilt at most every 100 ms
        stats = httpx.get(f"{gw}/admin/stats", headers=ADMIN).json()
        # and plain decoding's TPOT in the code slice, from the worker's estimate (specgate_plain_ratio): no code
        # request is ever served plain here (code-ngram comes before every bypass but an unverified pair's)
        return (any(key.startswith("*|code|ngram|") for key in stats["acceptance"])
                and any(key.startswith("code|") and key.endswith("|none") and arm["w"] > 0
                        for key, arm in stats["arms"].items()))

    deadline = time.monotonic() + 30
    while not learned():
        assert time.monotonic() < deadline, ("the code request's acceptance and its plain counterfactual never "
                                             "reached /admin/stats")
        time.sleep(0.05)
