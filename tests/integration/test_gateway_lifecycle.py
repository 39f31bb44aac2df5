"""A request ended at every stage gives back everything it held (``gateway.lifecycle.serve``).

A real gateway in front of the package's real worker, with a route capped at one request in flight and a
tokens-per-minute budget, and ``auto`` deciding (a fresh learner explores, so exploration slots are
taken). Each scenario ends requests one way (invalid body, limiter refusal, a worker's refusal, a worker
read timeout, a client leaving before the answer, mid-stream and before the stream's first byte, a
policy reload with new limits mid-request) and then asserts that ``/admin/requests`` is back at exactly
its idle values: no request in flight, no exploration slot, no route reservation, no worker slot. A scenario
that ends a request early also asserts that the worker stopped it: across the scenario the worker generated
fewer tokens than the request's ``max_tokens`` (a request that was never aborted upstream runs to all of
them), which is a count of the worker's own tokens, not a wall-clock bound. The waits for idle poll with a
generous deadline that only a hang exceeds; no assertion depends on this machine's speed.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from bench.processes import ADMIN, MODEL, gateway, write_policy
from bench.reliability.cluster import policy_yaml
from tests.integration.gateway_processes import CODE, generated_tokens

pytestmark = [pytest.mark.integration, pytest.mark.real_model]
KEY = {"authorization": "Bearer life-key-1"}
# a client leaves after 1 s (json, 0.5 s a read timeout) or a few chunks; the worker, ~57 ms a token on a 2-core
# Xeon, would have to be ~60x faster to generate all 1000 by then: aborted, a request generates a small part of
# them, never aborted, all of them (the worker's own token count tells them apart, whatever its speed)
LONG = {"max_tokens": 1000, "ignore_eos": True}
HANG_S = 300  # the deadline of a wait for idle: only a hang exceeds it


def _policy(worker: str, revision: str, max_concurrency: int = 1) -> str:
    routes = f"""routes:
  - {{name: capped, api_keys_env: LIFE_KEYS, max_concurrency: {max_concurrency},
     rate_limit: {{tokens_per_min: 1000000}}}}"""
    # `learned` decides the code prompts these tests send; a fresh learner serves each option once per slice
    # before its posterior draws decide (plain first), so its first answer takes an exploration slot
    return policy_yaml(plain=[worker], ngram=[worker], revision=revision, routes=routes,
                       rules="  - {name: learned, when: {slice: code}, then: auto}\n")


def _chat(content: str = CODE, **extra: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def _held(gw: str) -> dict:
    return httpx.get(f"{gw}/admin/requests", headers=ADMIN, timeout=10).json()


def _idle(worker: str) -> dict:
    return {"in_flight": 0, "exploring": {}, "workers_in_flight": 0,
            "routes": {"capped": {"in_flight": 0, "max_concurrency": 1, "tokens_available": 1000000.0}},
            "pools": {"plain": {worker: 0}, "ngram": {worker: 0}}}


def _assert_back_to_idle(gw: str, worker: str, after: str, generated_before: int | None = None) -> None:
    """Poll (the record of a whole answer lands one loop turn after it is sent; an abort is fire-and-forget)
    until nothing is held, then compare exactly. Tokens refill at ~16.7k/s, so a second restores them.

    With ``generated_before`` (the worker's ``generated_tokens`` before the scenario, whose requests are LONG):
    the worker must go idle having generated fewer than ``LONG["max_tokens"]`` tokens since, i.e. the gateway
    stopped its request upstream instead of leaving it to finish on its own."""
    deadline, held = time.monotonic() + HANG_S, _held(gw)
    while held != _idle(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
        held = _held(gw)
    assert held == _idle(worker), f"after {after}: the gateway still holds {held}"
    loads = httpx.get(f"{worker}/v1/loads", timeout=10).json()["loads"][0]
    deadline = time.monotonic() + HANG_S
    while loads["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.1)
        loads = httpx.get(f"{worker}/v1/loads", timeout=10).json()["loads"][0]
    assert loads["num_running_reqs"] == 0, f"after {after}: the worker still runs {loads}"
    if generated_before is not None:
        generated = generated_tokens(worker) - generated_before
        assert generated < LONG["max_tokens"], \
            f"after {after}: the worker generated {generated} of {LONG['max_tokens']} tokens: it was never aborted"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, worker_url, revision):
    tmp = tmp_path_factory.mktemp("life")
    path = write_policy(tmp / "policy.yaml", _policy(worker_url, revision))
    with gateway(tmp, path, env={"LIFE_KEYS": "life-key-1"}) as gw:
        yield gw, worker_url, path, revision


def _open_stream(http: httpx.Client, gw: str):
    return http.stream("POST", f"{gw}/v1/chat/completions", json=_chat(stream=True, **LONG), headers=KEY)


def test_refusals_before_dispatch_hold_nothing(stack):
    gw, worker, _, _ = stack
    r = httpx.post(f"{gw}/v1/chat/completions", content=b"{nope", headers=KEY, timeout=30)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_json")
    _assert_back_to_idle(gw, worker, "an invalid body")
    r = httpx.post(f"{gw}/v1/chat/completions", json=_chat(max_tokens=4), timeout=30)
    assert (r.status_code, r.json()["error"]["type"]) == (401, "authentication_error")
    _assert_back_to_idle(gw, worker, "a missing key")


def test_a_held_stream_is_counted_then_a_limiter_refusal_and_its_end_give_everything_back(stack):
    gw, worker, _, _ = stack
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{gw}/v1/chat/completions", headers=KEY,
                                                     json=_chat(stream=True, max_tokens=64)) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        held = _held(gw)
        assert (held["in_flight"], held["routes"]["capped"]["in_flight"], held["workers_in_flight"]) == (1, 1, 1)
        exploring = held["exploring"]
        r = http.post(f"{gw}/v1/chat/completions", json=_chat(max_tokens=4), headers=KEY)
        assert (r.status_code, r.json()["error"]["code"]) == (429, "concurrency_limit")
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    info = events[-1]["specgate"]
    key = f"{info['slice']}|{'none' if info['draft_tokens'] == 0 else info['pool']}"
    assert info["explored"], json.dumps(info)  # the first answer of a fresh learner explores (cold options)
    assert exploring == {key: 1}, (exploring, info)
    _assert_back_to_idle(gw, worker, "a limiter refusal beside a stream read to its end")


def test_a_worker_refusal_holds_nothing(stack):
    gw, worker, _, _ = stack
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    r = httpx.post(f"{gw}/v1/chat/completions", json=_chat(max_tokens=4, response_format=schema), headers=KEY,
                   timeout=60)
    assert r.status_code == 400 and "response_format" in r.json()["error"]["message"], r.text
    assert r.headers["x-specgate-pool"] in ("plain", "ngram")  # it was decided and dispatched
    _assert_back_to_idle(gw, worker, "the worker refused the request")


def test_answers_name_no_server_software(stack):
    """`specgate serve` runs uvicorn without its "server: uvicorn" header (cli/serve.UVICORN); Date stays."""
    gw, _, _, _ = stack
    for r in (httpx.post(f"{gw}/v1/chat/completions", json=_chat(max_tokens=2), headers=KEY, timeout=60),
              httpx.get(f"{gw}/health", timeout=10)):
        assert r.status_code == 200, r.text
        assert "server" not in r.headers and "date" in r.headers, dict(r.headers)


@pytest.mark.parametrize("where", ["json", "mid-stream", "before-first-byte"])
def test_a_client_that_leaves_gives_everything_back(stack, where):
    gw, worker, _, _ = stack
    before = generated_tokens(worker)
    if where == "json":
        with pytest.raises(httpx.ReadTimeout):  # gives up while the worker computes the whole answer
            httpx.post(f"{gw}/v1/chat/completions", json=_chat(**LONG), headers=KEY,
                       timeout=httpx.Timeout(1.0, connect=10.0))
    else:
        with httpx.Client(timeout=120) as http, _open_stream(http, gw) as r:
            assert r.status_code == 200
            if where == "mid-stream":
                lines = r.iter_lines()
                assert [line for _, line in zip(range(6), lines) if line]
        # leaving the block closes the connection; before-first-byte read nothing of the body
    _assert_back_to_idle(gw, worker, f"a client left ({where})", before)


def test_a_policy_reload_with_new_limits_mid_request_leaves_no_reservation(stack):
    gw, worker, path, revision = stack
    version = httpx.get(f"{gw}/admin/policy", headers=ADMIN, timeout=10).json()["version"]
    before = generated_tokens(worker)
    try:
        with httpx.Client(timeout=120) as http, _open_stream(http, gw) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")
            write_policy(path, _policy(worker, revision, max_concurrency=2))
            deadline = time.monotonic() + 60
            while httpx.get(f"{gw}/admin/policy", headers=ADMIN, timeout=10).json()["version"] == version:
                assert time.monotonic() < deadline, "the gateway did not reload the policy"
                time.sleep(0.1)
            # the reload moved the reservation to the route's new limiter; the stream ends under it
            assert _held(gw)["routes"]["capped"] == {"in_flight": 1, "max_concurrency": 2,
                                                     "tokens_available": pytest.approx(1e6, abs=2000)}
        deadline = time.monotonic() + 60
        while _held(gw)["routes"]["capped"]["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _held(gw)["routes"]["capped"]["in_flight"] == 0
    finally:
        write_policy(path, _policy(worker, revision))
        deadline = time.monotonic() + 60
        while _held(gw)["routes"]["capped"]["max_concurrency"] != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
    _assert_back_to_idle(gw, worker, "a reload with new limits mid-request", before)


def test_a_worker_read_timeout_gives_everything_back(tmp_path, worker_url, revision):
    """A whole answer asked for whole waits its whole generation for its first byte: past the read timeout it fails
    (one that may resume is streamed, and the bound applies per chunk: tests/backends/test_h1.py)."""
    path = write_policy(tmp_path / "policy.yaml", _policy(worker_url, revision) + "resume: {whole_answers: false}\n")
    with gateway(tmp_path, path, "--upstream-read-timeout-s", "0.5", env={"LIFE_KEYS": "life-key-1"}) as gw:
        before = generated_tokens(worker_url)
        r = httpx.post(f"{gw}/v1/chat/completions", json=_chat(**LONG), headers=KEY, timeout=120)
        assert r.status_code in (502, 503, 504), r.text
        assert "timed out" in r.json()["error"]["message"] or "timeout" in r.json()["error"]["message"].lower(), \
            r.text
        _assert_back_to_idle(gw, worker_url, "every attempt timed out", before)
