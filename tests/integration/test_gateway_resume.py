"""An answer survives its worker (gateway/resume.py), with real processes: two `specgate worker`s on fixed ports
(``bench.reliability.cluster.Workers``) behind one `specgate serve` with the trace recorder on; the worker serving
a stream is killed with SIGKILL after the client read some chunks, and restarted on its port afterwards.

Greedy: the client's text, the token ids the trace recorder kept and ``usage`` equal the same request's
uninterrupted answer (the embedded engine is batch-invariant, so a continuation from the prefix is the answer
plain decoding gives), for the plain, n-gram and suffix pools, with logprobs and with a stop string. Sampled with a
``seed``: the stream completes with every token counted once (what reproducibility holds: docs/reliability.md).
Bounds: a second failure beyond ``max_resumes`` ends with an error event naming it; a client that left is never
resumed. The SGLang wire of the continuation, at the fixture level: tests/gateway/test_resume.py."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from bench.processes import MODEL, gateway, write_policy
from bench.reliability.cluster import Workers, worker_load
from policies.trace import TraceError, read_trace
from tests.integration.gateway_processes import generated_tokens

pytestmark = [pytest.mark.integration, pytest.mark.real_model]

PROMPT = "Write a short story about a lighthouse keeper and a storm."
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n# write mul(a, b) like above\n"
KEYS = {"K_PLAIN": "key-plain", "K_NGRAM": "key-ngram", "K_SUFFIX": "key-suffix"}


@pytest.fixture(scope="module")
def pair(cluster_workers):
    return cluster_workers


def policy(workers: list[str], revision: str, max_resumes: int = 1) -> str:
    urls = ", ".join(f'"{u}"' for u in workers)
    return f"""version: 1
routes:
  - {{name: plain, api_keys_env: K_PLAIN}}
  - {{name: ngram, api_keys_env: K_NGRAM}}
  - {{name: suffix, api_keys_env: K_SUFFIX}}
slices: [{{name: all}}]
pairs:
  smollm2-ngram: {{target: {{model: {MODEL}, revision: "{revision}"}}, draft: {{kind: ngram}}}}
  smollm2-suffix: {{target: {{model: {MODEL}, revision: "{revision}"}}, draft: {{kind: suffix}}}}
pools:
  plain: {{proposer: none, workers: [{urls}], speculation: per_request}}
  ngram: {{proposer: ngram, draft_tokens: 4, pair: smollm2-ngram, workers: [{urls}], speculation: per_request}}
  suffix: {{proposer: suffix, draft_tokens: 4, pair: smollm2-suffix, workers: [{urls}], speculation: per_request}}
rules:
  - {{name: ngram, when: {{route: ngram}}, then: {{pool: ngram, draft_tokens: 4}}}}
  - {{name: suffix, when: {{route: suffix}}, then: {{pool: suffix, draft_tokens: 4}}}}
  - {{name: plain, then: bypass}}
resume: {{max_resumes: {max_resumes}}}
"""


def serving(workers: Workers) -> int:
    """The index of the worker running the (only) request in flight."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for i, url in enumerate(workers.urls):
            proc = workers.procs[i]
            if proc is not None and proc.poll() is None and worker_load(url)[0] >= 1:
                return i
        time.sleep(0.02)
    raise AssertionError("no worker runs the request")


def records(path, n: int) -> dict:
    deadline = time.monotonic() + 30
    while True:
        try:
            trace = read_trace(path)
            if len(trace.requests) >= n:
                return {r.id: r for r in trace.requests}
        except (OSError, TraceError):
            pass
        assert time.monotonic() < deadline, f"{n} records did not reach {path}"
        time.sleep(0.2)


class Gateway:
    def __init__(self, url: str, trace) -> None:
        self.url, self.trace = url, trace

    def client(self, route: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=f"key-{route}", max_retries=0, timeout=180)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text


@pytest.fixture
def gw(tmp_path, pair, revision, request):
    max_resumes = getattr(request, "param", 1)
    path = tmp_path / "traces" / "trace.jsonl"
    path.parent.mkdir()
    file = write_policy(tmp_path / "policy.yaml", policy(pair.urls, revision, max_resumes))
    try:
        with gateway(tmp_path, file, "--trace", str(path), "--log-level", "info", env=KEYS) as url:
            yield Gateway(url, path)
    finally:
        for i, proc in enumerate(pair.procs):  # a killed worker comes back on its port for the next test
            if proc is None or proc.poll() is not None:
                pair.restart(i)


def read(stream, chat: bool, *, kill=None, after: int = 4) -> tuple[str, list, list]:
    """(text, the content chunks' logprobs, every chunk as a dict); ``kill()`` after ``after`` content chunks."""
    text, logprobs, chunks, seen = "", [], [], 0
    for c in stream:
        d = c.to_dict()
        chunks.append(d)
        for choice in d.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if piece:
                text += piece
                seen += 1
                if seen == after and kill is not None:
                    kill()
            if chat and choice.get("logprobs"):
                logprobs.extend(choice["logprobs"]["content"] or ())
    return text, logprobs, chunks


@pytest.mark.parametrize("route", ["plain", "ngram", "suffix"])
def test_a_greedy_stream_survives_kill_9_token_identical(gw, pair, route):
    client = gw.client(route)
    body = dict(model=MODEL, messages=[{"role": "user", "content": CODE if route != "plain" else PROMPT}],
                max_tokens=64, temperature=0, stream=True, stream_options={"include_usage": True},
                logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    text0, logprobs0, chunks0 = read(client.chat.completions.create(**body), True)
    text, logprobs, chunks = read(client.chat.completions.create(**body), True,
                                  kill=lambda: pair.kill(serving(pair)))
    assert text == text0
    # logprobs continued, none twice; past the seam the prefix is recomputed by one prefill instead of token by
    # token, so a logprob may move in its 4th decimal (fp32 summation order), never the token chosen
    assert [e["token"] for e in logprobs] == [e["token"] for e in logprobs0] and len(logprobs) == 64
    assert all(abs(a["logprob"] - b["logprob"]) < 1e-3 for a, b in zip(logprobs, logprobs0))
    assert len({c["id"] for c in chunks}) == 1  # one stream id, the first worker's, to the end
    last = chunks[-1]
    assert last["usage"] == chunks0[-1]["usage"] and last["usage"]["completion_tokens"] == 64
    [finish] = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == "length"
    resumed = last["specgate"]["resumed"]
    assert resumed["count"] == 1 and resumed["steps"][0]["outcome"] == "ok"
    assert resumed["steps"][0]["pool"] == route and 4 <= resumed["steps"][0]["at_token"] < 64
    assert resumed["steps"][0]["from_worker"] != resumed["steps"][0]["to_worker"]
    ids = records(gw.trace, 2)  # one record per request, the resumed one included
    first, second = ids[chunks0[-1]["specgate"]["request_id"]], ids[last["specgate"]["request_id"]]
    assert second.output_ids == first.output_ids and second.prompt_ids == first.prompt_ids
    assert f'specgate_resumes_total{{outcome="ok",pool="{route}",route="{route}"}} 1.0' in gw.metrics()


def test_a_stop_string_and_a_completions_stream_resume_exactly(gw, pair):
    client = gw.client("plain")
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=64, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text0, _, _ = read(client.completions.create(**body), False)
    stop = text0[len(text0) * 2 // 3:][:10]  # late in the answer, after the seam
    body["stop"] = [stop]
    text1, _, chunks1 = read(client.completions.create(**body), False)
    text, _, chunks = read(client.completions.create(**body), False, kill=lambda: pair.kill(serving(pair)))
    assert text == text1 == text0[:text0.index(stop)]
    assert chunks[-1]["usage"] == chunks1[-1]["usage"]
    assert chunks[-1]["specgate"]["resumed"]["count"] == 1
    [finish] = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == "stop"


def test_a_whole_answer_is_assembled_as_the_worker_answers_it_and_resumes_token_identical(gw, pair):
    """``resume.whole_answers``: a whole answer is streamed from its worker and assembled at the gateway (the same
    choices and usage as the worker's own whole answer), so a worker killed mid-answer is resumed, token-identical,
    rather than served again from token 0."""
    client = gw.client("plain")
    body = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=64, temperature=0,
                logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole0 = client.chat.completions.with_raw_response.create(**body)
    direct = httpx.post(f"{pair.urls[0]}/v1/chat/completions", timeout=180, json={
        "model": MODEL, "messages": body["messages"], "max_tokens": 64, "temperature": 0, "logprobs": True,
        "top_logprobs": 2, "ignore_eos": True}).json()
    assembled = json.loads(whole0.content)
    assert assembled["choices"] == direct["choices"] and assembled["usage"] == direct["usage"]
    before = {url: generated_tokens(url) for url in pair.urls}

    def kill_mid_answer() -> None:
        i = serving(pair)
        url, deadline = pair.urls[i], time.monotonic() + 60
        while generated_tokens(url) < before[url] + 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        pair.kill(i)

    killer = threading.Thread(target=kill_mid_answer)
    killer.start()
    raw = client.chat.completions.with_raw_response.create(**body)
    killer.join()
    whole = json.loads(raw.content)
    assert whole["choices"][0]["message"] == assembled["choices"][0]["message"]
    assert [e["token"] for e in whole["choices"][0]["logprobs"]["content"]] == \
        [e["token"] for e in assembled["choices"][0]["logprobs"]["content"]]
    assert whole["usage"] == assembled["usage"] and whole["usage"]["completion_tokens"] == 64
    assert whole["choices"][0]["finish_reason"] == "length" and raw.headers["x-specgate-retries"] == "0"
    resumed = whole["specgate"]["resumed"]
    assert resumed["count"] == 1 and resumed["steps"][0]["outcome"] == "ok"
    assert 8 <= resumed["steps"][0]["at_token"] < 64


def test_a_sampled_stream_with_a_seed_completes_every_token_counted_once(gw, pair):
    client = gw.client("plain")
    body = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=64, temperature=0.8,
                seed=7, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, _, chunks = read(client.chat.completions.create(**body), True, kill=lambda: pair.kill(serving(pair)))
    last = chunks[-1]
    assert last["usage"]["completion_tokens"] == 64 and last["specgate"]["resumed"]["count"] == 1
    record = records(gw.trace, 1)[last["specgate"]["request_id"]]
    assert len(record.output_ids) == 64


@pytest.mark.parametrize("gw", [1], indirect=True)
def test_a_failure_beyond_max_resumes_ends_with_an_error_event(gw, pair):
    body = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=200, temperature=0,
                stream=True, ignore_eos=True)
    seen, error, killed_at, events = 0, None, set(), []
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=180,
                      headers={"Authorization": "Bearer key-plain"}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line)
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                error = obj["error"]
                continue
            seen += bool(obj["choices"] and obj["choices"][0]["delta"].get("content"))
            if seen in (4, 12) and seen not in killed_at:  # the first worker, then the one that took over
                killed_at.add(seen)
                pair.kill(serving(pair))
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"] == error
    assert error is not None and error["message"].endswith("; not resumed: limit"), error
    metrics = gw.metrics()
    assert 'specgate_resumes_total{outcome="ok",pool="plain",route="plain"} 1.0' in metrics
    assert 'specgate_resumes_total{outcome="limit",pool="plain",route="plain"} 1.0' in metrics


def test_a_client_that_left_is_never_resumed(gw, pair):
    body = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=200, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
    stream = gw.client("plain").chat.completions.create(**body)
    for seen, _ in enumerate(stream):
        if seen == 3:
            break
    index = serving(pair)
    stream.close()  # the client leaves
    other = pair.urls[1 - index]
    before = generated_tokens(other)
    pair.kill(index)
    time.sleep(2)
    assert worker_load(other)[0] == 0 and "specgate_resumes_total{" not in gw.metrics()
    assert generated_tokens(other) == before  # nothing continued there
