"""Short reliability runs through a real gateway to two real workers (tiny token budgets).

Soak (exact greedy answers, no cross-talk), client disconnects (workers back to baseline within a few
of their own token times), overload (caps and rate limits answer 429 + Retry-After, a noisy route does
not starve a quiet one),
policy reloads under load, and last (it kills a worker) faults: kill -9 mid-run, then restart.
The full-size run is ``python -m bench.reliability`` (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import statistics

import httpx
import pytest

from bench.processes import ADMIN_TOKEN, gateway, write_policy
from bench.reliability import scenarios
from bench.reliability.cluster import chat_body, listener_pid, policy_yaml, rss_mb, seconds_per_token

pytestmark = [pytest.mark.integration, pytest.mark.real_model, pytest.mark.timeout(300)]
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def _policy(tmp_path, workers, revision, **kw):
    urls = workers.urls
    return write_policy(tmp_path / "policy.yaml", policy_yaml(plain=urls, ngram=urls, revision=revision, **kw))


def test_soak_every_answer_exact_no_cross_talk(tmp_path, cluster_workers, revision):
    with gateway(tmp_path, _policy(tmp_path, cluster_workers, revision)) as gw:
        pids = [listener_pid(gw), *cluster_workers.pids()]
        rss0 = [rss_mb(p) for p in pids]
        report = asyncio.run(scenarios.soak(gw, cluster_workers.urls[0], clients=8, requests=24,
                                            max_tokens=8))
        rss1 = [rss_mb(p) for p in pids]
    print(f"soak: {report}; RSS MB start {rss0} end {rss1}")
    assert report.lost == 0 and report.mixed == 0
    assert report.exact == 24  # no fault injected: every answer is its own plain greedy answer
    assert rss1[0] < rss0[0] + 64, "gateway RSS grew by more than 64 MB over 24 requests"


# Disconnect-to-baseline is bounded in token times of the slower worker (``seconds_per_token``, one
# request alone), so the bound scales with the machine. Each of the 6 streams (3 per worker) has ~397
# of its 400 tokens left when it is cut: without the abort the workers stay busy that long. With it,
# baseline follows the gateway noticing the hang-up (the next token's write), the /abort_request, the
# engine finishing its step (a batch of 3, slower than the one-request unit), a health probe that may
# slip in, and a /v1/loads poll per worker: a few token times. 40 leaves ample room for the batch and
# stays 10x below the cost of a missing abort. The absolute figure is ``bench.reliability``'s
# worst_back_to_baseline_s.
ABORT_TOKENS = 40


def test_disconnects_abort_upstream_within_a_few_token_times(tmp_path, cluster_workers, revision):
    step = max(seconds_per_token(url) for url in cluster_workers.urls)
    with gateway(tmp_path, _policy(tmp_path, cluster_workers, revision)) as gw:
        worst = asyncio.run(scenarios.disconnects(gw, cluster_workers.urls, clients=6))
    print(f"disconnects: workers back to baseline {worst * 1e3:.0f} ms = {worst / step:.1f} token times "
          f"({step * 1e3:.0f} ms) after the last disconnect")
    assert worst < ABORT_TOKENS * step


def test_overload_caps_limits_and_no_starvation(tmp_path, cluster_workers, revision):
    policy = _policy(tmp_path, cluster_workers, revision, routes=scenarios.OVERLOAD_ROUTES)
    with gateway(tmp_path, policy, env=scenarios.OVERLOAD_KEYS) as gw:
        report = asyncio.run(scenarios.overload(gw, noisy=6, quiet=4))
    print(f"overload: {report}")
    # the 2 held streams fill max_concurrency 2 until closed: every one of the 4 fired meanwhile is refused
    assert report.noisy_status == {200: 2, 429: 4}
    assert report.retry_after_ok and report.hung == 0
    # burst 2, then one request per 100 s: exactly 2 of the 10 fired at once pass
    assert report.metered_status == {200: 2, 429: 8}
    assert report.quiet_status == {200: 4}
    quiet_p50 = statistics.median(report.quiet_under_load_s)
    assert quiet_p50 < 4 * statistics.median(report.quiet_alone_s) + 1.0, "the noisy route starved the quiet one"


def test_policy_reloads_under_load(tmp_path, cluster_workers, revision):
    path = _policy(tmp_path, cluster_workers, revision)
    with gateway(tmp_path, path) as gw:
        report = asyncio.run(scenarios.reloads(gw, path, cluster_workers.urls, revision, rounds=3))
    print(f"reloads: {report}")
    assert report.failed == 0 and report.requests >= 3 * 2 * 2  # each version let 2 (clients) finish
    assert report.rejections_reported == report.invalid_written == 3
    # each valid version took effect, and survived the invalid one after it (not the startup file)
    assert report.probes == [(f"valid-{n}", f"valid-{n}") for n in range(3) for _ in ("valid", "invalid")]
    assert report.reloaded_rules_seen == {"valid-0", "valid-1", "valid-2"}, "a reloaded version served no traffic"
    assert not report.invalid_rules_seen, "a rule of an invalid policy version served a request"


def test_worker_killed_mid_run_then_restarted(tmp_path, cluster_workers, revision):
    a, b = cluster_workers.urls
    policy = write_policy(tmp_path / "policy.yaml", policy_yaml(plain=[a, b], ngram=[b], revision=revision))
    with gateway(tmp_path, policy) as gw:
        report = asyncio.run(scenarios.kill_worker(gw, cluster_workers, 1, in_flight=4, after=4))
        print(f"faults: {report}")
        assert report.silent == 0, "a stream ended without [DONE] or hung"
        # every stream the kill cut was resumed on the other worker (gateway/resume.py), text for text
        assert report.inflight_resumed >= 1, "no stream was cut by the kill: the test did not test it"
        assert report.inflight_errors == 0 and report.inflight_ok == 4
        assert report.resumed_exact == report.inflight_resumed
        assert report.after_ok == 4  # retried elsewhere or routed around the ejected worker
        # the policy says: a speculative pool with no healthy worker has no verified pair (pair_verified is None,
        # backends/sglang/pool.py), so the first rule, `unverified-pair` (pair_verified: false), matches and
        # bypasses: the rule's choice, not the built-in safety fallback (which `code-ngram` would hit, flagged)
        assert report.fallback_pool == "plain"
        assert report.fallback_reason == "rule 'unverified-pair' (pair_verified is False) bypasses speculation"
        assert report.fallback_flag is False
        assert report.ejected
        assert report.readmitted_after_s is not None
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat_body(scenarios.CODE[0], 4, stream=False),
                       timeout=60)
        assert r.status_code == 200 and r.headers["x-specgate-pool"] == "ngram"
