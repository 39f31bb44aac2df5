"""Telemetry end to end: a known sequence of requests through a real `specgate serve` in front of a real
`specgate worker`, then the gateway's /metrics counters must equal what the responses reported, and
/dashboard/data must hold the same requests."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.processes import MODEL, gateway, worker, write_policy
from tests.integration.gateway_processes import CODE, policy_text

pytestmark = [pytest.mark.integration, pytest.mark.real_model]


def _samples(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{base}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _total(found, name: str, **match: str) -> float:
    return sum(v for (n, labels), v in found.items() if n == name and match.items() <= dict(labels).items())


@pytest.fixture(scope="module")
def gw(tmp_path_factory, prepared_model):
    tmp = tmp_path_factory.mktemp("telemetry")
    with worker(tmp, "--max-running-requests", "4", "--num-threads", "1") as url:
        policy = write_policy(tmp / "policy.yaml", policy_text([url], revision=prepared_model.revision))
        with gateway(tmp, policy) as base:
            yield base


def test_known_requests_give_exact_counters(gw):
    chat = f"{gw}/v1/chat/completions"
    responses = [httpx.post(chat, json={"model": MODEL, "messages": [{"role": "user", "content": CODE}],
                                        "max_tokens": n, "temperature": 0}, timeout=120).json() for n in (12, 16)]
    plain = httpx.post(chat, json={"model": MODEL, "messages": [{"role": "user", "content": "Hi there."}],
                                   "max_tokens": 4}, timeout=120).json()
    bad = httpx.post(chat, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1})
    assert bad.status_code == 400
    assert [(r["specgate"]["rule"], r["specgate"]["pool"]) for r in responses] == [("code-ngram", "ngram")] * 2
    assert (plain["specgate"]["rule"], plain["specgate"]["pool"]) == ("tiny-budget", "plain")

    deadline = time.monotonic() + 10
    while _total(found := _samples(gw), "specgate_requests_total") < 4:  # observed after the last byte
        assert time.monotonic() < deadline, "the gateway did not count 4 requests"
        time.sleep(0.1)
    code = dict(route="default", slice="code", pool="ngram", proposer="ngram")
    assert _total(found, "specgate_requests_total", **code, rule="code-ngram", status="ok") == 2
    assert _total(found, "specgate_requests_total", slice="prose", pool="plain", proposer="none",
                  rule="tiny-budget", status="ok") == 1
    assert _total(found, "specgate_requests_total", status="client_error") == 1
    assert _total(found, "specgate_requests_total") == 4
    everything = responses + [plain]
    assert _total(found, "specgate_output_tokens_total") == sum(r["usage"]["completion_tokens"] for r in everything)
    assert _total(found, "specgate_prompt_tokens_total") == sum(r["usage"]["prompt_tokens"] for r in everything)
    assert _total(found, "specgate_spec_rounds_total", **code) == sum(r["specgate"]["verify_rounds"] for r in responses)
    assert _total(found, "specgate_spec_rounds_total") == _total(found, "specgate_spec_rounds_total", **code)
    assert _total(found, "specgate_spec_accept_length_count", **code) == 2
    assert _total(found, "specgate_spec_accept_length_sum", **code) == pytest.approx(
        sum(r["specgate"]["accept_length"] for r in responses))
    assert _total(found, "specgate_time_to_first_token_seconds_count") == 3
    # whole (non-streamed) answers have a TPOT too: the worker's decode time / (n - 1)
    two_plus = [r["usage"]["completion_tokens"] >= 2 for r in everything]
    assert _total(found, "specgate_time_per_output_token_seconds_count") == sum(two_plus)
    assert _total(found, "specgate_time_per_output_token_seconds_sum") > 0
    assert _total(found, "specgate_slo_met_total") + _total(found, "specgate_slo_missed_total") == 3
    assert _total(found, "specgate_pool_workers", pool="ngram") == 1
    assert _total(found, "specgate_policy_last_reload_success") == 1

    data = httpx.get(f"{gw}/dashboard/data").json()
    groups = data["series"]["groups"]
    assert sum(sum(g["requests"]) for g in groups) == 4
    # the "TPOT speculative vs plain" chart has both lines for this non-streamed traffic
    assert sum(sum(g["tpot_spec_n"]) for g in groups) == sum(two_plus[:2])
    assert sum(sum(g["tpot_plain_n"]) for g in groups) == two_plus[2]
    # the realised-speedup table counts the same requests, each in its slice and load bucket
    cells = [c for c in data["speedup"]["cells"] if c["route"] == "*"]
    assert sum(c["spec_n"] for c in cells) == sum(two_plus[:2]) and sum(c["plain_n"] for c in cells) == two_plus[2]
    assert httpx.get(f"{gw}/dashboard").status_code == 200
