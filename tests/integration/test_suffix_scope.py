"""Suffix decoding's scope through real processes: a gateway with two routes in front of one `specgate worker`
launched with `--speculative-algorithm SUFFIX` (a server-mode suffix pool). The same greedy prompt is sent
on route a, route b, a, b: each route's second request drafts from its own first answer (more drafts
accepted), and route b's first request gets nothing from route a's answer (the same statistics as a's
first). The gateway, not the client, picks the scope: a client's custom_params is refused.

One worker and four 24-token requests: this machine has 2 shared cores."""

from __future__ import annotations

import httpx
import pytest

from bench.processes import MODEL, gateway, worker, write_policy

pytestmark = [pytest.mark.integration, pytest.mark.real_model]
KEYS = {"a": "key-a", "b": "key-b"}
PROMPT = "Call get_weather for Lyon, then for Paris, as JSON."


def _policy(url: str, revision: str) -> str:
    return f"""version: 1
routes:
  - {{name: a, api_keys_env: SCOPE_KEYS_A}}
  - {{name: b, api_keys_env: SCOPE_KEYS_B}}
slices: [{{name: prose}}]
pairs:
  smollm2-suffix: {{target: {{model: SmolLM2-135M-Instruct, revision: "{revision}"}}, draft: {{kind: suffix}}}}
pools:
  plain: {{proposer: none, workers: ["{url}"], speculation: per_request}}
  suffix: {{proposer: suffix, draft_tokens: 8, pair: smollm2-suffix, workers: ["{url}"]}}
rules:
  - {{name: unverified-pair, when: {{pair_verified: false}}, then: bypass}}
  - {{name: suffix, then: {{pool: suffix, draft_tokens: 8}}}}
"""


def _ask(gw: str, route: str, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
            "temperature": 0, **extra}
    return httpx.post(f"{gw}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEYS[route]}"},
                      timeout=120)


def _served(r: httpx.Response, route: str) -> tuple[str, tuple[int, ...], int]:
    """(text, accepted-drafts histogram, drafts proposed) of a 200 answer served by the suffix pool."""
    assert r.status_code == 200, r.text
    assert (r.headers["x-specgate-route"], r.headers["x-specgate-pool"], r.headers["x-specgate-rule"]) == (
        route, "suffix", "suffix")
    body = r.json()
    spec = body["sglext"]["spec_tokens_details"]
    return (body["choices"][0]["message"]["content"], tuple(spec["spec_correct_drafts_histogram"]),
            spec["spec_num_proposed_drafts"])


def test_each_route_drafts_only_from_its_own_earlier_answers(tmp_path, prepared_model):
    with worker(tmp_path, "--speculative-algorithm", "SUFFIX", "--speculative-num-draft-tokens", "8",
                "--max-running-requests", "2", "--num-threads", "1") as url:
        policy = write_policy(tmp_path / "policy.yaml", _policy(url, prepared_model.revision))
        with gateway(tmp_path, policy, env={"SCOPE_KEYS_A": KEYS["a"], "SCOPE_KEYS_B": KEYS["b"]}) as gw:
            a1 = _served(_ask(gw, "a"), "a")
            b1 = _served(_ask(gw, "b"), "b")
            a2 = _served(_ask(gw, "a"), "a")
            b2 = _served(_ask(gw, "b"), "b")
            foreign = _ask(gw, "b", custom_params={"speculation": {"scope": "a"}})
    assert a1[0] == b1[0] == a2[0] == b2[0] and a1[0]  # greedy: the same answer whatever was drafted
    assert b1 == a1  # route a's answer is not in route b's tree: b's first request drafts as a's first did
    assert b2 == a2  # each route's second request drafts from its own first answer alone

    def accepted(histogram: tuple[int, ...]) -> int:
        return sum(n * rounds for n, rounds in enumerate(histogram))

    assert accepted(a2[1]) > accepted(a1[1]), (a1, a2)
    assert foreign.status_code == 400 and foreign.json()["error"]["param"] == "custom_params"
