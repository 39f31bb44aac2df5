"""Full-information evidence through real processes (gateway/evidence.py): a gateway whose auto rule offers a fixed
n-gram pool and a fixed suffix pool, in front of one calibrated `specgate worker`. Every greedy answer teaches
the learner both options, whichever served it (the served one by its own outcome, the other by its
counterfactual rounds priced with the worker's live step costs); a sampled answer teaches only its own; the
client never sees the token ids the gateway asked for."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from bench.processes import ADMIN, MODEL, gateway, worker, write_policy

pytestmark = [pytest.mark.integration, pytest.mark.real_model]
PROMPT = "List the first five prime numbers, then explain why 9 is not prime."


def _policy(url: str, revision: str) -> str:
    return f"""version: 1
slices: [{{name: prose}}]
pairs:
  ng: {{target: {{model: SmolLM2-135M-Instruct, revision: "{revision}"}}, draft: {{kind: ngram}}}}
  sx: {{target: {{model: SmolLM2-135M-Instruct, revision: "{revision}"}}, draft: {{kind: suffix}}}}
pools:
  plain: {{proposer: none, workers: ["{url}"], speculation: per_request}}
  ngram: {{proposer: ngram, draft_tokens: 4, pair: ng, workers: ["{url}"], speculation: per_request}}
  suffix: {{proposer: suffix, draft_tokens: 8, pair: sx, workers: ["{url}"], speculation: per_request}}
rules:
  - {{name: unverified-pair, when: {{pair_verified: false}}, then: bypass}}
  - {{name: learned, then: {{pools: [ngram, suffix]}}}}
"""


def _observations(gw: str) -> float:
    text = httpx.get(f"{gw}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith('specgate_counterfactual_observations_total{route="default",slice="prose"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_for(gw: str, want: float) -> float:
    deadline = time.monotonic() + 120
    got = _observations(gw)
    while got < want and time.monotonic() < deadline:
        time.sleep(0.2)
        got = _observations(gw)
    return got


def _idle(gw: str) -> None:
    """Wait until the gateway's last load report from the worker shows nothing running: a report still showing
    the previous answer would put the next decision (and ``/admin/explain``) in the next load bucket, where this
    test's evidence is not filed. The load counts once the answer ends, so a slow machine only waits longer."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        views = httpx.get(f"{gw}/admin/pools", timeout=30, headers=ADMIN).json()
        loads = [w["load"] for pool in views.values() for w in pool["workers"]]
        if all(load is not None and load["running"] + load["waiting"] == 0 for load in loads):
            return
        time.sleep(0.1)
    raise AssertionError(f"the worker never reported idle: {loads}")


def test_every_greedy_answer_teaches_both_fixed_options(tmp_path, prepared_model):
    with worker(tmp_path, "--max-running-requests", "2", "--num-threads", "1", calibrate=True) as url:
        policy = write_policy(tmp_path / "policy.yaml", _policy(url, prepared_model.revision))
        with gateway(tmp_path, policy) as gw:
            taught = 0.0
            pools = []
            for _ in range(3):
                _idle(gw)
                r = httpx.post(f"{gw}/v1/chat/completions", timeout=300, json={
                    "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16,
                    "temperature": 0})
                assert r.status_code == 200, r.text
                body = r.json()
                assert "output_ids" not in json.dumps(body) and "input_ids" not in json.dumps(body)
                pool = body["specgate"]["pool"]
                pools.append(pool)
                taught += 2 if pool == "plain" else 1  # the rule's fixed options it was not served with
                assert _wait_for(gw, taught) == taught, pools
            # the first request is served plain (every option is cold in an empty learner); it teaches both
            # pools, so neither is ever served cold afterwards
            assert pools[0] == "plain"
            _idle(gw)  # as before each greedy request: a stale load report would file it in another load bucket
            sampled = httpx.post(f"{gw}/v1/chat/completions", timeout=300, json={
                "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16,
                "temperature": 0.8, "seed": 1})
            assert sampled.status_code == 200, sampled.text
            assert sampled.json()["specgate"].get("exploration") != "cold"
            time.sleep(1.0)
            assert _observations(gw) == taught  # a sampled answer teaches only the option it got
            _idle(gw)
            explained = httpx.post(f"{gw}/admin/explain", timeout=30, headers=ADMIN, json={
                "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "temperature": 0})
            assert explained.status_code == 200, explained.text
            samples = {c["pool"]: c["samples"] for c in explained.json()["candidates"]}
            # every greedy answer counted for both (decayed a little since: half-life 600 s)
            assert samples["ngram"] > 2.5 and samples["suffix"] > 2.5, samples
