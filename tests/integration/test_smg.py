"""SGLang's own gateway (smg 1.13.0, a Rust binary nobody here wrote) in front of a real `specgate worker`.

It must register the worker under its served model name, read its loads, forward /generate and chat
requests (stream and not), and pass the worker's 429 through without ejecting it.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from bench.processes import BIN, free_port, running, worker

pytestmark = [pytest.mark.integration, pytest.mark.real_model]
GEN = {"text": "The three primary colors are", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
CHAT = {"model": "smol", "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 6,
        "temperature": 0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, prepared_model):
    tmp = tmp_path_factory.mktemp("smg")
    with worker(tmp, "--served-model-name", "smol", "--num-threads", "1", "--max-running-requests", "1",
                "--max-queued-requests", "1") as worker_url:
        port, metrics = free_port(), free_port()
        argv = [str(BIN / "smg"), "launch", "--worker-urls", worker_url, "--policy", "round_robin",
                "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(metrics), "--worker-startup-check-interval", "1", "--log-level", "warn"]
        smg = f"http://127.0.0.1:{port}"
        with running(argv, f"{smg}/health", tmp / "smg.log"):
            _listed(f"{smg}/workers", "workers", 60)  # smg answers /health before it has registered the worker
            yield worker_url, smg


def _listed(url: str, key: str, within_s: float) -> list[dict]:
    """Poll smg until `url` lists something under `key`."""
    deadline = time.monotonic() + within_s
    while not (items := httpx.get(url, timeout=30).json()[key]):
        assert time.monotonic() < deadline, f"smg listed no {key} at {url} within {within_s} s"
        time.sleep(0.2)
    return items


def _sse(text: str) -> list[dict]:
    events = [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_smg_registers_the_worker_and_reads_its_loads(stack):
    worker_url, smg = stack
    workers = httpx.get(f"{smg}/workers", timeout=10).json()["workers"]
    assert [(w["url"], w["model_id"], w["runtime_type"]) for w in workers] == [(worker_url, "smol", "sglang")]
    assert workers[0]["models"][0]["context_length"] == 8192
    assert workers[0]["labels"]["served_model_name"] == "smol"
    assert [m["id"] for m in httpx.get(f"{smg}/v1/models", timeout=10).json()["data"]] == ["smol"]
    load = _listed(f"{smg}/get_loads", "loads", 30)[0]  # a fresh clone's CI once got [] here, worker registered
    assert load["worker"] == worker_url
    # values only this worker reports: smg parsed our /v1/loads
    assert (load["max_total_num_tokens"], load["max_running_requests"]) == (65536, 1)


def test_generate_through_smg_matches_the_worker(stack):
    worker_url, smg = stack
    direct = httpx.post(f"{worker_url}/generate", json=GEN, timeout=60).json()
    via = httpx.post(f"{smg}/generate", json=GEN, timeout=60)
    assert via.status_code == 200
    assert via.json()["output_ids"] == direct["output_ids"]
    assert via.json()["meta_info"]["spec_verify_ct"] == 6
    streamed = httpx.post(f"{smg}/generate", json={**GEN, "stream": True}, timeout=60)
    assert streamed.status_code == 200
    chunks = _sse(streamed.text)
    assert chunks[-1]["text"] == direct["text"] and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_chat_through_smg_stream_and_not(stack):
    worker_url, smg = stack
    direct = httpx.post(f"{worker_url}/v1/chat/completions", json=CHAT, timeout=60).json()
    via = httpx.post(f"{smg}/v1/chat/completions", json=CHAT, timeout=60)
    assert via.status_code == 200
    assert via.json()["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    streamed = httpx.post(f"{smg}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60)
    assert streamed.status_code == 200
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in _sse(streamed.text) if c["choices"])
    assert text == direct["choices"][0]["message"]["content"]


def test_overload_is_429_through_smg_and_the_worker_stays_registered(stack):
    worker_url, smg = stack
    long = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}

    async def go():
        async with httpx.AsyncClient(timeout=120) as http:
            running_req = asyncio.create_task(http.post(f"{worker_url}/generate", json={**long, "rid": "hog-1"}))
            queued_req = asyncio.create_task(http.post(f"{worker_url}/generate", json={**long, "rid": "hog-2"}))
            deadline = time.monotonic() + 60
            while True:  # one running, one waiting: the queue (max 1) is full
                load = (await http.get(f"{worker_url}/v1/loads")).json()["loads"][0]
                if (load["num_running_reqs"], load["num_waiting_reqs"]) == (1, 1):
                    break
                hogs = [t.result().text[:300] for t in (running_req, queued_req) if t.done()]
                assert time.monotonic() < deadline, f"worker never got full: {load}; hogs: {hogs}"
                await asyncio.sleep(0.05)
            refused = await http.post(f"{smg}/generate", json=GEN)
            for rid in ("hog-1", "hog-2"):
                await http.post(f"{worker_url}/abort_request", json={"rid": rid})
            await asyncio.gather(running_req, queued_req)
            return refused
    refused = asyncio.run(go())
    assert refused.status_code == 429, refused.text
    assert "waiting queue is full" in refused.text
    workers = httpx.get(f"{smg}/workers", timeout=10).json()["workers"]
    assert [w["url"] for w in workers] == [worker_url]
    assert httpx.post(f"{smg}/generate", json=GEN, timeout=60).status_code == 200
