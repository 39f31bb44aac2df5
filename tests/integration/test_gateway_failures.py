"""Failure handling of the gateway as a real process in front of real workers: client disconnects
(the worker request is aborted and its KV freed), auth and rate limits, policy reloads that must not take
a bad version, a killed worker, no healthy worker. Fixtures in conftest.py.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from bench.processes import ADMIN, MODEL, gateway, worker, write_policy
from tests.integration.gateway_processes import policy_text

pytestmark = [pytest.mark.integration, pytest.mark.real_model]


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
    from bench.processes import free_port

    policy = write_policy(tmp_path / "p.yaml",
                          policy_text([f"http://127.0.0.1:{free_port()}"], revision=revision))
    with gateway(tmp_path, policy) as url:
        assert httpx.get(f"{url}/ready").status_code == 503
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "no_healthy_worker"
