"""Metrics: exact counter values and histogram buckets for a known sequence of records; bounded labels."""

from __future__ import annotations

import random
import string
from pathlib import Path

import pytest

from gateway.telemetry_views import policy_view
from policies.load import load_policy
from telemetry import RequestRecord, Telemetry
from telemetry.derive import positions_from_histogram
from telemetry.series import History
from telemetry.views import PoolView, WorkerView
from tests.telemetry.exposition import lab, only, samples

POLICY = Path(__file__).with_name("policy.yaml")
IDE_CODE = dict(route="ide", slice="code", pool="ngram", proposer="ngram")
CHAT_PROSE = dict(route="chat", slice="prose", pool="plain", proposer="none")


pytestmark = pytest.mark.usefixtures("quiet_logs")


def known_sequence() -> list[RequestRecord]:
    return [
        # per-position counts from the worker
        RequestRecord(request_id="a", rule="code-ngram", draft_tokens=4, prompt_tokens=100, completion_tokens=12,
                      ttft_s=0.3, tpot_s=0.02, e2e_s=0.52, verify_ct=5, num_correct_drafts=7, num_proposed_drafts=20,
                      accept_length=2.4, accepted_per_position=[4, 2, 1, 0], reached_per_position=[5, 4, 2, 1],
                      slo_met=True, overhead_s=0.0015, **IDE_CODE),
        # only a histogram of accepted drafts per round (SGLang): positions, drafts, accepted are derived
        RequestRecord(request_id="b", rule="code-ngram", draft_tokens=4, prompt_tokens=50, completion_tokens=11,
                      ttft_s=0.6, tpot_s=0.06, e2e_s=1.2, verify_ct=4, correct_drafts_histogram=[1, 1, 0, 2, 0],
                      slo_met=False, **IDE_CODE),
        RequestRecord(request_id="c", rule="learned", prompt_tokens=10, completion_tokens=50, ttft_s=0.1,
                      tpot_s=0.04, e2e_s=2.06, slo_met=True, exploration="thompson", **CHAT_PROSE),
        RequestRecord(request_id="d", rule="learned", status="upstream_error", http_status=502, prompt_tokens=10,
                      e2e_s=0.05, error_type="upstream_error", error_message="connection reset", **CHAT_PROSE),
        # rejected before a decision: no pool, no rule
        RequestRecord(request_id="e", route="chat", slice="prose", pool="", proposer="none", rule="",
                      status="client_error", http_status=400),
    ]


def test_known_sequence_gives_exact_counters(policy):
    telemetry = Telemetry(policy)
    for record in known_sequence():
        telemetry.observe(record)
    found = samples(telemetry)
    assert only(found, "specgate_requests_total") == {
        lab(**IDE_CODE, rule="code-ngram", status="ok"): 2,
        lab(**CHAT_PROSE, rule="learned", status="ok"): 1,
        lab(**CHAT_PROSE, rule="learned", status="upstream_error"): 1,
        lab(route="chat", slice="prose", pool="none", proposer="none", rule="none", status="client_error"): 1,
    }
    ide = lab(**IDE_CODE)
    assert only(found, "specgate_spec_rounds_total") == {ide: 9}
    assert only(found, "specgate_spec_draft_tokens_total") == {ide: 20 + 4 * 4}
    assert only(found, "specgate_spec_accepted_tokens_total") == {ide: 7 + 7}
    # b's histogram [1, 1, 0, 2, 0]: accepted_j = sum(h[j:]) = 3, 2, 2, 0; reached_j = sum(h[j-1:]) = 4, 3, 2, 2
    assert only(found, "specgate_spec_position_accepted_tokens_total") == {
        lab(**IDE_CODE, position="1"): 7, lab(**IDE_CODE, position="2"): 4,
        lab(**IDE_CODE, position="3"): 3, lab(**IDE_CODE, position="4"): 0}
    assert only(found, "specgate_spec_position_reached_total") == {
        lab(**IDE_CODE, position="1"): 9, lab(**IDE_CODE, position="2"): 7,
        lab(**IDE_CODE, position="3"): 4, lab(**IDE_CODE, position="4"): 3}
    assert found[("specgate_output_tokens_total", ide)] == 23
    assert found[("specgate_prompt_tokens_total", ide)] == 150
    assert found[("specgate_output_tokens_total", lab(**CHAT_PROSE))] == 50
    assert only(found, "specgate_slo_met_total") == {ide: 1, lab(**CHAT_PROSE): 1}
    assert only(found, "specgate_slo_missed_total") == {ide: 1}
    # c explored (plain decoding, a posterior draw)
    assert only(found, "specgate_explorations_total") == {lab(**CHAT_PROSE, kind="thompson"): 1}
    # the exposition text itself carries the exact line
    text = telemetry.metrics_response()[0].decode()
    assert ('specgate_spec_rounds_total{pool="ngram",proposer="ngram",route="ide",slice="code"} 9.0'
            in text.splitlines())


def test_histograms_bucket_exactly(policy):
    telemetry = Telemetry(policy)
    for record in known_sequence():
        telemetry.observe(record)
    found = samples(telemetry)
    tpot = {dict(k)["le"]: v for k, v in only(found, "specgate_time_per_output_token_seconds_bucket").items()
            if dict(k)["route"] == "ide"}
    # 0.02 lands in le="0.02" (bounds are inclusive), 0.06 in le="0.075"
    assert (tpot["0.015"], tpot["0.02"], tpot["0.05"], tpot["0.075"], tpot["+Inf"]) == (0, 1, 1, 2, 2)
    ide = lab(**IDE_CODE)
    assert found[("specgate_time_per_output_token_seconds_count", ide)] == 2
    assert found[("specgate_time_per_output_token_seconds_sum", ide)] == pytest.approx(0.08)
    ttft = {dict(k)["le"]: v for k, v in only(found, "specgate_time_to_first_token_seconds_bucket").items()
            if dict(k)["route"] == "ide"}
    assert (ttft["0.25"], ttft["0.5"], ttft["0.75"]) == (0, 1, 2)
    # accept length: a reports 2.4; b's is derived, 1 + 7 / 4 = 2.75; plain requests are not observed
    accept = {dict(k)["le"]: v for k, v in only(found, "specgate_spec_accept_length_bucket").items()}
    assert len(accept) == 16 and (accept["2.0"], accept["2.5"], accept["3.0"], accept["+Inf"]) == (0, 1, 2, 2)
    assert found[("specgate_spec_accept_length_sum", ide)] == pytest.approx(5.15)
    # e2e of the failed request (0.05 s) is observed too; d has no TTFT
    e2e = {dict(k)["le"]: v for k, v in only(found, "specgate_request_duration_seconds_bucket").items()
           if dict(k)["route"] == "chat"}
    assert (e2e["0.1"], e2e["2.0"], e2e["5.0"]) == (1, 1, 2)
    assert found[("specgate_time_to_first_token_seconds_count", lab(**CHAT_PROSE))] == 1
    telemetry.observe_overhead(0.02)
    found = samples(telemetry)
    overhead = {dict(k)["le"]: v for k, v in only(found, "specgate_gateway_overhead_seconds_bucket").items()}
    assert (overhead["0.001"], overhead["0.002"], overhead["0.025"], overhead["+Inf"]) == (0, 1, 2, 2)


def test_positions_from_histogram():
    assert positions_from_histogram([1, 1, 0, 2, 0]) == ((3, 2, 2, 0), (4, 3, 2, 2))
    assert positions_from_histogram([5]) == ((), ())


def _junk(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_letters + string.digits + "-_/{}\"\\ ") for _ in range(rng.randint(1, 40)))


def test_cardinality_is_bounded_under_random_labels(policy):
    """Random routes, slices, pools, rules, statuses, ids and key-like strings never become labels."""
    telemetry = Telemetry(policy)
    rng = random.Random(1234)
    junk: set[str] = set()
    for i in range(1500):
        values = {f: _junk(rng) if rng.random() < 0.7 else rng.choice(real)
                  for f, real in (("route", ["ide", "chat"]), ("slice", ["code", "prose"]),
                                  ("pool", ["ngram", "plain"]), ("proposer", ["ngram", "none"]),
                                  ("rule", ["learned"]), ("status", ["ok"]))}
        junk.update(v for v in values.values() if len(v) > 12)
        telemetry.observe(RequestRecord(request_id=f"sk-{rng.getrandbits(64):x}", worker=_junk(rng),
                                        draft_tokens=rng.randint(0, 40), verify_ct=rng.randint(1, 9),
                                        accepted_per_position=[1] * 40, reached_per_position=[2] * 40,
                                        completion_tokens=3, **values))
    found = samples(telemetry)
    values_of: dict[str, set[str]] = {}
    for _, labels in found:
        for name, value in labels:
            values_of.setdefault(name, set()).add(value)
    assert values_of["route"] <= {"ide", "chat", "other"}
    assert values_of["slice"] <= {"code", "prose", "tool_call", "other"}
    assert values_of["pool"] <= {"ngram", "plain", "draft", "other", "none"}
    assert values_of["proposer"] <= {"none", "ngram", "draft_model", "eagle", "eagle3", "standalone", "other"}
    assert values_of["rule"] <= {"unverified-pair", "kv-pressure", "code-ngram", "learned", "(none)", "other", "none"}
    assert values_of["status"] <= {"ok", "client_error", "rate_limited", "upstream_error", "aborted",
                                   "unavailable", "other"}
    assert values_of["position"] == {str(j) for j in range(1, 17)}
    # series per counter: at most 3 routes x 4 slices x 5 pools x 7 proposers (x 16 positions)
    assert len(only(found, "specgate_spec_position_reached_total")) <= 3 * 4 * 5 * 7 * 16
    text = telemetry.metrics_response()[0].decode()
    assert not [j for j in junk if j in text]
    assert "sk-" not in text


def _pool(name: str, urls: list[str], workers: tuple[WorkerView, ...] = (), **kw) -> PoolView:
    base = dict(workers=len(urls), healthy_workers=len(urls), running=3, waiting=1, in_flight=2,
                kv_usage=0.42, accept_length=2.5, pair_verified=True)
    return PoolView(name=name, worker_states=workers, **{**base, **kw})


def test_pool_and_worker_gauges_follow_the_latest_snapshot(policy):
    telemetry = Telemetry(policy)
    telemetry.set_pools([
        _pool("ngram", ["http://127.0.0.1:30001"], pair_verified=False,
              workers=(WorkerView(url="http://127.0.0.1:30001", healthy=True, running=3, waiting=1, kv_usage=0.42),
                       WorkerView(url="http://evil.example:666", healthy=False))),
        _pool("plain", ["http://127.0.0.1:30000"], kv_usage=None, accept_length=None, pair_verified=None),
        _pool("rogue", ["http://10.0.0.9:1"])])
    found = samples(telemetry)
    assert only(found, "specgate_pool_running_requests") == {lab(pool="ngram"): 3, lab(pool="plain"): 3,
                                                             lab(pool="other"): 3}
    assert only(found, "specgate_pool_kv_usage_ratio") == {lab(pool="ngram"): 0.42, lab(pool="other"): 0.42}
    assert only(found, "specgate_pool_healthy_workers")[lab(pool="ngram")] == 1
    pair = {dict(k)["pool"] + ":" + dict(k)["specgate_pool_pair_verification"]
            for k, v in only(found, "specgate_pool_pair_verification").items() if v == 1}
    assert pair == {"ngram:mismatch", "plain:unknown", "other:verified"}
    assert only(found, "specgate_worker_healthy") == {lab(pool="ngram", worker="http://127.0.0.1:30001"): 1,
                                                      lab(pool="ngram", worker="other"): 0}
    assert only(found, "specgate_worker_kv_usage_ratio") == {lab(pool="ngram", worker="http://127.0.0.1:30001"): 0.42}
    # a later snapshot without a pool removes its series (no stale gauges)
    telemetry.set_pools([_pool("plain", ["http://127.0.0.1:30000"], running=0)])
    found = samples(telemetry)
    assert only(found, "specgate_pool_running_requests") == {lab(pool="plain"): 0}
    assert only(found, "specgate_worker_healthy") == {}


def test_policy_version_and_reload_status(policy):
    telemetry = Telemetry(policy)
    found = samples(telemetry)
    assert found[("specgate_policy_last_reload_success", ())] == 1
    assert only(found, "specgate_policy_reloads_total") == {lab(result="ok"): 1}
    telemetry.set_policy(policy, version="v7", reload_ok=True)
    telemetry.set_policy(policy, version="v7", reload_ok=False, error="rules[2].then: unknown pool 'x'")
    found = samples(telemetry)
    assert only(found, "specgate_policy_info") == {lab(version="v7"): 1}
    assert found[("specgate_policy_last_reload_success", ())] == 0
    assert only(found, "specgate_policy_reloads_total") == {lab(result="ok"): 2, lab(result="error"): 1}
    assert telemetry.dashboard_data()["policy"]["error"] == "rules[2].then: unknown pool 'x'"
    # a policy without route "ide" makes "ide" an unknown label from now on
    text = POLICY.read_text().replace("  - {name: ide, api_keys_env: SPECGATE_TEST_KEYS_IDE, slo: {tpot_ms: 30}}\n", "")
    telemetry.set_policy(policy_view(load_policy(text, "policy-without-ide.yaml")), version="v8", reload_ok=True)
    telemetry.observe(RequestRecord(request_id="x", rule="code-ngram", **IDE_CODE))
    assert only(samples(telemetry), "specgate_requests_total") == {
        lab(route="other", slice="code", pool="ngram", proposer="ngram", rule="code-ngram", status="ok"): 1}


def test_dashboard_history_sums_and_stays_bounded(policy):
    history = History(width_s=5.0, size=4)
    telemetry = Telemetry(policy, history=history)
    for i, record in enumerate(known_sequence()):
        telemetry.observe(RequestRecord(**{**{f: getattr(record, f) for f in record.__struct_fields__},
                                           "timestamp": 1000.0 + i}))
    series = telemetry.dashboard_data(now=1009.0)["series"]
    assert series["t"] == [1000.0, 1005.0]
    groups = {(g["route"], g["slice"]): g for g in series["groups"]}
    assert groups[("ide", "code")]["rounds"] == [9, 0] and groups[("ide", "code")]["accepted"] == [14, 0]
    assert groups[("chat", "prose")]["requests"] == [3, 0] and groups[("chat", "prose")]["errors"] == [2, 0]
    assert groups[("chat", "prose")]["explored"] == [1, 0] and groups[("ide", "code")]["explored"] == [0, 0]
    assert groups[("ide", "code")]["slo_met"] == [1, 0] and groups[("ide", "code")]["slo_missed"] == [1, 0]
    positions = telemetry.dashboard_data(now=1009.0)["positions"]
    assert positions == [{"route": "ide", "slice": "code", "pool": "ngram", "accepted": [7, 4, 3, 0],
                          "reached": [9, 7, 4, 3]}]
    # an hour later: only `size` buckets are kept, and records older than the window are dropped
    assert len(telemetry.dashboard_data(now=4600.0)["series"]["t"]) == 4
    telemetry.observe(RequestRecord(request_id="old", rule="learned", timestamp=1000.0, **CHAT_PROSE))
    assert all(sum(g["requests"]) == 0 for g in telemetry.dashboard_data(now=4600.0)["series"]["groups"])
