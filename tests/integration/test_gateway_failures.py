"""Failure handling of the gateway as a real process in front of real workers: client disconnects
(the worker request is aborted and its KV freed), auth and rate limits, policy reloads that must not take
a bad version, a killed worker, no healthy worker. Fixtures in conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import openai
import pytest

from bench.processes import ADMIN, MODEL, gateway, worker, write_policy
from bench.reliability.cluster import seconds_per_token, wait_until, worker_load
from tests.integration.gateway_processes import policy_text

pytestmark = [pytest.mark.integration, pytest.mark.real_model]

# Disconnect-to-idle is bounded in token times of the same worker (``seconds_per_token``, measured
# just before), so the bound scales with the machine. Every request below has >= 190 tokens left when
# the client hangs up: without the abort the worker stays busy that many token times (measured with the
# abort removed: 340-540). With it, idle follows the gateway noticing the hang-up (at most one more
# token's write), the /abort_request round trip, the engine finishing the step it is in, a health probe
# that may slip in (one token) and one /v1/loads poll: a few token times (1-3 measured). 25 leaves 8x
# room above that and stays 7x below what a missing abort costs.
ABORT_TOKENS = 25


def _load(worker_url: str) -> dict:
    return httpx.get(f"{worker_url}/v1/loads", timeout=10).json()["loads"][0]


def _wait_idle(worker_url: str, what: str, timeout: float = 60.0) -> float:
    """The monotonic time at which the worker showed no running request and no KV in use."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker_load(worker_url) == (0, 0.0):
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError(f"the worker is still busy {timeout:.0f} s {what}: {_load(worker_url)}")


def _freed_within(worker_url: str, closed: float, step: float) -> None:
    freed = _wait_idle(worker_url, "after the disconnect") - closed
    assert freed < ABORT_TOKENS * step, (
        f"the worker was idle {freed:.2f} s after the disconnect: {freed / step:.1f} token times "
        f"(one token {step * 1e3:.0f} ms), over the {ABORT_TOKENS} an abort takes")


def test_disconnect_mid_stream_aborts_the_worker_request(gw, worker_url):
    step = seconds_per_token(worker_url)
    _wait_idle(worker_url, "before the request")  # a health probe may be running
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{gw}/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            seen = [line for _, line in zip(range(6), lines) if line]
            assert seen and seen[0].startswith("data: ")
            running, usage = worker_load(worker_url)
            assert running == 1 and usage > 0, "the request should run and hold KV before the disconnect"
        closed = time.monotonic()  # leaving the block closes the connection mid-stream
    _freed_within(worker_url, closed, step)  # no request running and its KV given back


def _aborted_count(gw: str) -> float:
    text = httpx.get(f"{gw}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specgate_requests_total{") and 'status="aborted"' in line)


def _hang_up_once_running(url: str, path: str, body: dict, worker_url: str) -> float:
    """POST a long non-streaming request and hang up as soon as the worker runs it (so nearly all of
    its tokens are still to come); the monotonic time of the hang-up."""
    _wait_idle(worker_url, "before the request")

    def running() -> bool:  # more KV than a health probe (one-token prompt, one token) holds
        load = _load(worker_url)
        return load["num_running_reqs"] == 1 and load["num_used_tokens"] > 2

    async def post_and_hang_up() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as http:
            request = asyncio.create_task(http.post(f"{url}{path}", json=body))
            await wait_until(lambda: request.done() or running(), timeout=60)
            if request.done():
                raise AssertionError(f"answered before the hang-up: {request.result().text[:300]}")
            request.cancel()  # httpcore closes a connection whose response was not read to the end
            with contextlib.suppress(asyncio.CancelledError):
                await request

    asyncio.run(post_and_hang_up())
    return time.monotonic()


LONG_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
             "max_tokens": 200, "ignore_eos": True}


def test_disconnect_before_a_json_answer_aborts_the_worker_request(gw, worker_url):
    step = seconds_per_token(worker_url)
    before = _aborted_count(gw)
    closed = _hang_up_once_running(gw, "/v1/chat/completions", LONG_CHAT, worker_url)
    _freed_within(worker_url, closed, step)
    deadline = time.monotonic() + 30
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
    step = seconds_per_token(worker_url)
    closed = _hang_up_once_running(worker_url, path, body, worker_url)
    _freed_within(worker_url, closed, step)


def test_auth_and_rate_limits(tmp_path, worker_url, revision):
    # route ide refills one request per 1000 s and batch's one stream stays in flight until closed
    # (400 tokens, ignore_eos): both refusals hold however slow the machine is
    routes = """routes:
  - {name: ide, api_keys_env: TEST_KEYS_IDE, rate_limit: {requests_per_s: 0.001, burst: 1}}
  - {name: batch, api_keys_env: TEST_KEYS_BATCH, max_concurrency: 1}"""
    policy = write_policy(tmp_path / "p.yaml", policy_text([worker_url], revision=revision, routes=routes))
    with gateway(tmp_path, policy, env={"TEST_KEYS_IDE": "key-ide", "TEST_KEYS_BATCH": "k1,k2"}) as url:
        msg = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        r = httpx.post(f"{url}/v1/chat/completions", json=msg)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{url}/v1/chat/completions", json=msg, headers={"authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ide = {"authorization": "Bearer key-ide"}
        first = httpx.post(f"{url}/v1/chat/completions", json=msg, headers=ide, timeout=60)
        assert first.status_code == 200 and first.headers["x-specgate-route"] == "ide"
        second = httpx.post(f"{url}/v1/chat/completions", json=msg, headers=ide)
        assert second.status_code == 429 and second.json()["error"]["code"] == "request_rate_limit"
        # Retry-After: the 1000 s a whole request takes to refill, less the time since the first one
        assert 900 < int(second.headers["retry-after"]) <= 1000
        batch = openai.OpenAI(base_url=f"{url}/v1", api_key="k2", max_retries=0)
        stream = batch.chat.completions.create(stream=True, **{**msg, "max_tokens": 400},
                                               extra_body={"ignore_eos": True})
        next(iter(stream))  # one request in flight on route batch
        with pytest.raises(openai.RateLimitError, match="max_concurrency 1"):
            batch.chat.completions.create(**msg)
        stream.close()


def _wait(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_policy_reload_via_configmap_symlink_swap(tmp_path, worker_url, revision):
    """Kubernetes swaps ``..data`` to a new directory. Valid A (startup) -> valid B -> invalid C: C is
    kept out and reported, and B, not A, keeps serving (only B has the rule ``prose-pinned``)."""
    def version_dir(name: str, text: str) -> str:
        (tmp_path / name).mkdir()
        write_policy(tmp_path / name / "policy.yaml", text)
        return name

    def swap(target: str) -> None:
        (tmp_path / "..tmp").symlink_to(target)
        (tmp_path / "..tmp").replace(tmp_path / "..data")

    def status() -> dict:
        return httpx.get(f"{url}/admin/policy", headers=ADMIN).json()

    def served() -> tuple[str, str]:
        r = httpx.post(f"{url}/v1/chat/completions", json=msg, timeout=60)
        assert r.status_code == 200, r.text
        return r.headers["x-specgate-rule"], r.headers["x-specgate-draft-tokens"]

    a = policy_text([worker_url], revision=revision)
    b = a.replace("  - {name: learned, then: auto}",
                  "  - {name: prose-pinned, when: {slice: prose}, then: {pool: ngram, "
                  "draft_tokens: 2}}\n  - {name: learned, then: auto}")
    c = b.replace("then: {pool: ngram, draft_tokens: 4}", "then: {pool: ngrm}")
    assert a != b != c and "prose-pinned" not in a
    (tmp_path / "..data").symlink_to(version_dir("a", a))
    (tmp_path / "policy.yaml").symlink_to("..data/policy.yaml")
    msg = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8}
    with gateway(tmp_path, tmp_path / "policy.yaml") as url:
        version_a = status()["version"]
        assert served()[0] != "prose-pinned"
        swap(version_dir("b", b))
        version_b = _wait(lambda: (v := status()["version"]) != version_a and v)
        assert status()["last_reload"]["ok"] is True
        assert served() == ("prose-pinned", "2")
        swap(version_dir("c", c))
        report = _wait(lambda: (r := status())["last_reload"]["ok"] is False and r)
        assert report["version"] == version_b
        assert any("policy.yaml:" in e and "ngrm" in e for e in report["last_reload"]["errors"])
        assert served() == ("prose-pinned", "2")


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
            assert dead["consecutive_failures"] >= 1 and dead["last_error"].startswith(f"{doomed}: ")
            # nothing listens any more (ConnectError), or a kept-alive connection was cut by the kill (a CI run
            # saw "RemoteProtocolError: server disconnected without sending a complete response")
            assert any(f": {kind}: " in dead["last_error"] for kind in ("ConnectError", "RemoteProtocolError",
                                                                       "ReadError")), dead["last_error"]


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
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 503
        assert ready.json() == {"ready": False, "healthy_workers": {"ngram": 0, "plain": 0}}
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "no_healthy_worker"
