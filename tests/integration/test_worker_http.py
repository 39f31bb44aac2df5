"""A real `specgate worker` process (real model) driven over HTTP with the SGLang client.

One worker per module (started with NGRAM k=4 by default, 2 running slots, a queue of 1) keeps the
model load to once. Token counts stay small: this machine has 2 shared cores.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from backends.sglang.client import SGLangClient
from backends.sglang.errors import WorkerHTTPError
from backends.sglang.wire import GenerateRequest, SamplingParams
from bench.processes import worker
from tests.integration.gateway_processes import generated_tokens

pytestmark = [pytest.mark.integration, pytest.mark.real_model]
CODE = ("Copy the line.\nLine: the quick brown fox jumps over the lazy dog\n"
        "Copy: the quick brown fox jumps over the lazy dog\nLine: the quick brown fox jumps over the lazy dog\nCopy:")


@pytest.fixture(scope="module")
def url(tmp_path_factory, prepared_model):
    with worker(tmp_path_factory.mktemp("worker"), "--speculative-algorithm", "NGRAM",
                "--speculative-num-draft-tokens", "4", "--max-running-requests", "2",
                "--max-queued-requests", "1", "--served-model-name", "smol", "--num-threads", "1") as base:
        yield base


def _run(coro):
    return asyncio.run(coro)


def _req(max_new: int = 8, speculation: dict | None = None, **kw) -> GenerateRequest:
    custom = {"speculation": speculation} if speculation else None
    return GenerateRequest(text=CODE, sampling_params=SamplingParams(
        max_new_tokens=max_new, temperature=0.0, custom_params=custom, **kw.pop("sampling", {})), **kw)


async def _loads(client: SGLangClient):
    return (await client.loads()).loads[0]


def test_greedy_output_is_identical_across_proposers_and_meta_is_exact(url, prepared_model):
    async def go():
        async with SGLangClient(url) as client:
            default = await client.generate(_req())  # the worker's NGRAM k=4
            plain = await client.generate(_req(speculation={"proposer": "none"}))
            draft = await client.generate(_req(speculation={"proposer": "draft_model", "draft_tokens": 2}))
            info = await client.server_info()
            return default, plain, draft, info
    default, plain, draft, info = _run(go())
    assert default.output_ids == plain.output_ids == draft.output_ids
    n = len(plain.output_ids)
    assert default.text == plain.text and n == 8
    m, p = default.meta_info, plain.meta_info
    assert m.finish_reason.type == "length" and m.completion_tokens == n and m.weight_version == "default"
    assert m.spec_num_proposed_drafts > 0  # the prompt repeats itself: prompt lookup finds drafts
    # every round commits its accepted drafts + one token (no stop cut a round here)
    assert m.spec_verify_ct + m.spec_num_correct_drafts == n
    assert m.spec_accept_length == pytest.approx(n / m.spec_verify_ct)
    assert sum(m.spec_correct_drafts_histogram) == m.spec_verify_ct
    assert p.spec_num_proposed_drafts == 0 and p.spec_verify_ct == n
    assert info.revision == prepared_model.revision and info.speculative_algorithm == "NGRAM"
    assert info.served_model_name == "smol" and info.speculative_num_draft_tokens == 4


def test_stream_deltas_rebuild_the_text(url):
    async def go():
        async with SGLangClient(url) as client:
            deltas = [d async for d in client.generate_stream(_req(6))]
            whole = await client.generate(_req(6))
            return deltas, whole
    deltas, whole = _run(go())
    assert "".join(d.text for d in deltas) == whole.text
    assert [d.finished for d in deltas][-1] is True and not any(d.finished for d in deltas[:-1])
    assert deltas[-1].meta_info.spec_verify_ct == whole.meta_info.spec_verify_ct
    assert deltas[-1].meta_info.e2e_latency > 0


def test_abort_request_stops_a_stream(url):
    async def go():
        async with SGLangClient(url) as client:
            seen = []
            async for delta in client.generate_stream(_req(200, rid="abort-me", sampling={"ignore_eos": True})):
                seen.append(delta)
                if len(seen) == 1:
                    await client.abort("abort-me")
            return seen, await _loads(client)
    seen, load = _run(go())
    assert seen[-1].meta_info.finish_reason.type == "abort"
    assert seen[-1].meta_info.completion_tokens < 200
    assert load.num_running_reqs == 0


def test_client_disconnect_aborts_the_engine_request(url):
    """The client leaves after the first chunk of a 1000-token request; the worker must stop it there. Told
    apart from a request left to finish by the worker's own token count, not by a time window: the worker
    goes idle having generated far fewer than the 1000 tokens (a request never aborted generates them all)."""
    max_new = 1000

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=30) as http, SGLangClient(url) as client:
            body = {"text": CODE, "stream": True, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}
            async with http.stream("POST", "/generate", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break
            deadline = time.monotonic() + 300  # only a hang exceeds it
            while (load := await _loads(client)).num_running_reqs and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return load
    before = generated_tokens(url)
    load = _run(go())
    generated = generated_tokens(url) - before
    assert (load.num_running_reqs, load.num_waiting_reqs, load.num_used_tokens) == (0, 0, 0)
    assert generated < max_new, f"the worker generated all {generated} tokens: the disconnect never aborted it"


def test_concurrent_requests_queue_and_overload_answers_429(url):
    async def go():
        async with SGLangClient(url) as client:
            streams = [client.generate_stream(_req(200, rid=f"long-{i}", sampling={"ignore_eos": True}))
                       for i in range(2)]
            firsts = await asyncio.gather(*(anext(s) for s in streams))  # both running now
            queued = asyncio.create_task(client.generate(_req(4, rid="queued")))
            for _ in range(600):  # the queued request reaches the engine's queue within a few ms
                if (await _loads(client)).num_waiting_reqs == 1:
                    break
                await asyncio.sleep(0.05)
            busy = await _loads(client)
            with pytest.raises(WorkerHTTPError) as refused:
                await client.generate(_req(4))
            for i in range(2):
                await client.abort(f"long-{i}")
            tails = [[d async for d in s] for s in streams]
            return firsts, busy, refused.value, await queued, tails
    firsts, busy, refused, queued, tails = _run(go())
    assert all(not f.finished for f in firsts)
    assert (busy.num_running_reqs, busy.num_waiting_reqs) == (2, 1)
    assert 0 < busy.token_usage < 1 and busy.num_used_tokens > 0
    assert refused.status == 429 and "waiting queue is full" in str(refused)
    assert queued.meta_info.completion_tokens == 4 and queued.meta_info.id == "queued"
    assert all(t[-1].meta_info.finish_reason.type == "abort" for t in tails)


@pytest.mark.parametrize(("body", "param"), [
    (b"{oops", None),
    (json.dumps({"text": CODE, "sampling_params": {"top_p": 1.5}}).encode(), "sampling_params.top_p"),
    (json.dumps({"text": CODE, "sampling_params": {"bogus": 1}}).encode(), "sampling_params"),
    (json.dumps({"text": "x" * 40000}).encode(), "text"),
])
def test_bad_input_is_400_over_the_wire(url, body, param):
    response = httpx.post(f"{url}/generate", content=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_chat_and_probes(url):
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "smol", "messages": [{"role": "user", "content": "Count: 1, 2, 3,"}], "max_tokens": 4,
        "temperature": 0, "return_spec_tokens_details": True}).json()
    assert chat["usage"]["completion_tokens"] <= 4
    assert chat["sglext"]["spec_tokens_details"]["spec_verify_ct"] >= 1
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert 'sglang:generation_tokens_total{model_name="smol"}' in metrics
    assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["max_model_len"] == 8192
