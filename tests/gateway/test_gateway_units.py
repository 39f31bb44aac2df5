"""Pure parts of the gateway: keys -> routes, token buckets and caps, request validation messages,
worker-error mapping, the JSON splice, the policy watcher (incl. a ConfigMap symlink swap), TPOT by source."""

from __future__ import annotations

import os

import pytest

from backends.sglang.errors import WorkerConnectError, WorkerHTTPError
from gateway.auth import KeyRing, admin_allowed
from gateway.errors import ApiError, from_worker
from gateway.limits import RouteLimiter, TokenBucket, limiters_for
from gateway.reload import PolicyWatcher
from gateway.relay import inject
from gateway.requests import ChatRequest, CompletionRequest, parse_body
from policies.load import load_policy
from policies.schema import RateLimit, Route

BASE = """version: 1
slices: [{name: prose}]
pools: {plain: {proposer: none, workers: ["http://127.0.0.1:1"]}}
"""


def _policy(routes: str = ""):
    return load_policy(BASE + routes, "p.yaml")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_keys_from_env_and_file_select_routes(tmp_path):
    (tmp_path / "keys.txt").write_text("# team b\nkey-b1\nkey-b2, key-b3\n")
    ring = KeyRing(_policy("routes:\n  - {name: a, api_keys_env: KEYS_A}\n"
                           "  - {name: b, api_keys_file: keys.txt}\n"),
                   base_dir=tmp_path, environ={"KEYS_A": "key-a"})
    assert ring.enabled and ring.key_count == 4 and ring.problems == []
    assert ring.route_for("Bearer key-a") == "a"
    assert ring.route_for("bearer key-b3") == "b"
    with pytest.raises(ApiError) as exc:
        ring.route_for("Bearer key-c")
    assert exc.value.status == 401 and exc.value.code == "invalid_api_key"
    with pytest.raises(ApiError):
        ring.route_for(None)


def test_unknown_key_falls_to_the_keyless_route_and_missing_env_is_reported():
    ring = KeyRing(_policy("routes:\n  - {name: a, api_keys_env: KEYS_A}\n  - {name: open}\n"), environ={})
    assert ring.route_for("Bearer whatever") == "open" and ring.route_for(None) == "open"
    assert ring.problems == ["route 'a': environment variable KEYS_A is not set; the route has no keys"]


def test_auth_off_accepts_any_token():
    ring = KeyRing(_policy())
    assert not ring.enabled and ring.route_for("Bearer x") == "default" and ring.route_for(None) == "default"


def test_admin_token_check():
    assert admin_allowed("s3cret", "Bearer s3cret")
    assert not admin_allowed("s3cret", "Bearer s3cre")
    assert not admin_allowed(None, "Bearer anything")
    assert not admin_allowed("s3cret", None)


def test_token_bucket_refills_and_says_when():
    bucket = TokenBucket(rate_per_s=2.0, capacity=4, now=0.0)
    assert bucket.take(4, 0.0) is None
    assert bucket.take(1, 0.0) == pytest.approx(0.5)
    assert bucket.take(1, 0.5) is None
    bucket.give_back(10, 0.5)
    assert bucket.level == 4


def test_route_limiter_requests_tokens_and_concurrency():
    clock = Clock()
    route = Route(name="r", rate_limit=RateLimit(requests_per_s=1, tokens_per_min=600, burst=2), max_concurrency=2)
    lim = RouteLimiter(route, clock)
    lim.admit(100)
    lim.admit(100)
    with pytest.raises(ApiError) as exc:
        lim.admit(100)
    assert exc.value.status == 429 and exc.value.code == "concurrency_limit" and exc.value.headers() == {"retry-after": "1"}
    lim.finish(0)
    with pytest.raises(ApiError) as exc:  # the request bucket (burst 2) is empty: 1 s at 1/s
        lim.admit(100)
    assert exc.value.code == "request_rate_limit" and exc.value.retry_after == pytest.approx(1.0)
    clock.t += 1.0
    with pytest.raises(ApiError) as exc:  # 400 tokens left + 10 refilled; 500 needed -> 9 s at 10/s
        lim.admit(500)
    assert exc.value.code == "token_rate_limit" and exc.value.retry_after == pytest.approx(9.0)
    assert lim.requests.level == pytest.approx(1.0)  # the refused request gave its slot back
    with pytest.raises(ApiError, match="allows 600 tokens per minute"):
        lim.admit(601)


def test_limiters_keep_state_across_reload_when_unchanged():
    route = Route(name="r", max_concurrency=3)
    old = limiters_for([route], ["r"], {})
    old["r"].in_flight = 2
    same = limiters_for([route], ["r"], old)
    assert same["r"] is old["r"]
    changed = limiters_for([Route(name="r", max_concurrency=5)], ["r"], old)
    assert changed["r"] is not old["r"] and changed["r"].in_flight == 2



def test_a_request_admitted_before_a_limits_change_finishes_on_the_new_limiter():
    first = limiters_for([Route(name="r", max_concurrency=1)], ["r"], {})
    first["r"].admit(10)  # in flight when the reload lands
    second = limiters_for([Route(name="r", max_concurrency=2)], ["r"], first)
    third = limiters_for([Route(name="r", max_concurrency=3)], ["r"], second)
    assert third["r"].in_flight == 1
    first["r"].finish(0)  # the request ends on the limiter that admitted it: the count leaves the current one
    assert (third["r"].in_flight, third["r"].max_concurrency) == (0, 3)
    third["r"].admit(10)
    third["r"].admit(10)
    third["r"].admit(10)
    with pytest.raises(ApiError, match="max_concurrency 3"):
        third["r"].admit(10)


@pytest.mark.parametrize(("raw", "param", "message"), [
    (b"{", None, "request body is not valid JSON"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temprature": 1}', "temprature",
     "invalid field `temprature`: Object contains unknown field `temprature`; remove it"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x", "colour": 1}]}', "messages[0].colour",
     "invalid field `messages[0].colour`: Object contains unknown field `colour`; remove it"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}', "temperature",
     "invalid field `temperature`: Expected `float` <= 2.0"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}', "n",
     "n must be 1 (one choice per request), got 2"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', None,
     "invalid request: Object missing required field `model`"),
    (b'{"model": "m", "messages": []}', "messages", "messages is empty; send at least one message"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', "top_logprobs",
     "top_logprobs needs logprobs: true; set it or remove top_logprobs"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}',
     "top_logprobs", "invalid field `top_logprobs`: Expected `int` <= 20"),
])
def test_chat_validation_messages(raw, param, message):
    with pytest.raises(ApiError) as exc:
        parse_body(raw, ChatRequest)
    assert exc.value.status == 400 and exc.value.param == param
    assert exc.value.message.startswith(message), exc.value.message


def test_completion_prompts():
    body, req = parse_body(b'{"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}', CompletionRequest)
    assert body["prompt"] == [1, 2, 3] and req.budget == 4
    with pytest.raises(ApiError, match="batched prompts are not supported"):
        parse_body(b'{"model": "m", "prompt": ["a", "b"]}', CompletionRequest)
    with pytest.raises(ApiError, match="prompt is empty"):
        parse_body(b'{"model": "m", "prompt": ""}', CompletionRequest)
    with pytest.raises(ApiError, match=r"invalid field `logprobs`: Expected `int` >= 0") as exc:
        parse_body(b'{"model": "m", "prompt": "a", "logprobs": -1}', CompletionRequest)
    assert exc.value.param == "logprobs"
    assert parse_body(b'{"model": "m", "prompt": "a", "logprobs": 3}', CompletionRequest)[1].logprobs == 3


def test_worker_errors_map_to_client_statuses():
    ctx = from_worker(WorkerHTTPError("u", 400, "the prompt has 9000 tokens but the model's context window is 8192"))
    assert (ctx.status, ctx.code, ctx.param) == (400, "context_length_exceeded", "messages")
    busy = from_worker(WorkerHTTPError("u", 429, "queue full", retry_after=3))
    assert (busy.status, busy.headers()) == (429, {"retry-after": "3"})
    assert from_worker(WorkerHTTPError("u", 500, "boom")).status == 502
    assert from_worker(WorkerConnectError("u", "refused")).status == 502
    assert ApiError(503, "x").body() == b'{"error":{"message":"x","type":"service_unavailable","param":null,"code":null}}'


def test_inject_splices_without_reencoding():
    assert inject(b'{"id":"a","choices":[]} \n', b'{"pool":"p"}') == b'{"id":"a","choices":[],"specgate":{"pool":"p"}}'


def test_watcher_follows_a_configmap_symlink_swap(tmp_path):
    applied, rejected = [], []
    for name, text in (("v1", BASE), ("v2", BASE.replace("prose", "chat")), ("v3", BASE + "bogus: 1\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "policy.yaml").write_text(text)
    (tmp_path / "..data").symlink_to("v1")
    (tmp_path / "policy.yaml").symlink_to("..data/policy.yaml")
    watcher = PolicyWatcher(tmp_path / "policy.yaml", "start", apply=lambda p, v: applied.append(p),
                            reject=rejected.append)

    def swap(target: str) -> None:
        (tmp_path / "..tmp").symlink_to(target)
        os.replace(tmp_path / "..tmp", tmp_path / "..data")
        watcher.poll()

    watcher.poll(force=True)  # first content differs from "start": loaded
    swap("v2")
    assert [p.slices[0].name for p in applied] == ["prose", "chat"]
    swap("v3")
    assert rejected[0].ok is False
    assert [p.slices[0].name for p in applied] == ["prose", "chat"]  # nothing re-applied: v2 stays
    assert rejected[0].errors[0].startswith("policy.yaml:4:1: bogus")
    watcher.poll(force=True)  # same bad content again: not re-reported
    assert len(rejected) == 1


def test_the_specgate_object_says_whether_the_decision_explored():
    import json

    import msgspec

    from gateway.stages import Arrival, Dispatched, Relayed, info_json
    from policies.decide import Decision

    arrival = Arrival(request_id="r1", endpoint="chat", t0=0.0)
    served = Dispatched(pool="ngram", proposer="ngram", draft_tokens=8, worker="http://w", rid="r1-1", retries=0,
                        fallback=False, fallback_note="")
    d = Decision(slice="code", pool="ngram", proposer="ngram", draft_tokens=8, bypass=False, rule="learned",
                 reason="rule 'learned' auto: exploring cold pool 'ngram' k=8 (0 rounds of evidence)",
                 exploration="cold")
    for decision, flag, kind in ((d, True, "cold"), (msgspec.structs.replace(d, exploration=None), False, None)):
        info = json.loads(info_json(arrival, "r", decision, served, Relayed()))
        assert (info["explored"], info["exploration"], info["pool"], info["draft_tokens"], info["rule"]) == (
            flag, kind, "ngram", 8, "learned")
        assert (info["predicted_speedup"], info["expected_accept_length"]) == (None, None)
        assert info["posterior_tpot_ms"] is None
    posterior = {"plain decoding": 41.5, "ngram k=8": 30.25}
    exploit = msgspec.structs.replace(d, exploration=None, predicted_speedup=1.31, expected_accept_length=2.4,
                                      posterior_tpot_ms=posterior)
    info = json.loads(info_json(arrival, "r", exploit, served, Relayed()))
    assert (info["predicted_speedup"], info["expected_accept_length"], info["posterior_tpot_ms"]) == (
        1.31, 2.4, posterior)


def _finished(relayed, *, stream: bool, e2e_s: float = 2.0, mean_concurrency: float = 1.0):
    from gateway.stages import OK, Arrival, Dispatched, Finished
    from policies.decide import Decision

    arrival = Arrival(request_id="r1", endpoint="chat", t0=0.0)
    decision = Decision(slice="code", pool="ngram", proposer="ngram", draft_tokens=4, bypass=False, rule="r",
                        reason="r")
    served = Dispatched(pool="ngram", proposer="ngram", draft_tokens=4, worker="http://w", rid="r1-1", retries=0,
                        fallback=False, fallback_note="")
    return Finished(arrival=arrival, route="default", stream=stream, admitted=None, decision=decision,
                    dispatched=served, retries=0, relayed=relayed, ending=OK, e2e_s=e2e_s, overhead_s=0.001,
                    mean_concurrency=mean_concurrency, slo=None, pair_version="")


def _answer(details: str) -> bytes:
    """A whole chat answer of 11 tokens, as a worker sends it; ``details``: its spec_tokens_details."""
    return (b'{"id":"a","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,"message":'
            b'{"role":"assistant","content":"x"},"finish_reason":"length"}],"usage":{"prompt_tokens":5,'
            b'"completion_tokens":11,"total_tokens":16},"sglext":{"spec_tokens_details":' + details.encode() + b'}}')


def test_a_whole_answer_has_the_workers_tpot_and_a_real_sglang_one_has_none():
    """Non-streamed: TPOT = the worker's decode time / (n - 1), exactly, for telemetry and the learner; a worker
    that sends no decode time (a real SGLang server) gives no TPOT to telemetry, and the learner keeps e2e / n."""
    import msgspec

    from backends.sglang.openai_wire import ChatCompletionResponse
    from gateway.relay import Tally
    from gateway.stages import outcome, record

    embedded = ('{"spec_verify_ct":4,"spec_num_correct_drafts":7,"specgate_first_token_s":0.5,'
                '"specgate_decode_s":0.25}')
    for details, tpot, source, learned in ((embedded, 0.025, "worker", 0.025),
                                           ('{"spec_verify_ct":4,"spec_num_correct_drafts":7}', None, None, 2.0 / 11)):
        tally = Tally(0.0)
        tally.take(msgspec.json.decode(_answer(details), type=ChatCompletionResponse))
        f = _finished(tally.relayed(), stream=False)
        assert (f.tpot_s, f.tpot_source) == (tpot, source)
        rec = record(f)
        assert (rec.tpot_s, rec.tpot_source, rec.ttft_s) == (tpot, source, 2.0)  # a whole answer's TTFT: e2e
        assert outcome(f).tpot_s == learned
    # the worker's counterfactual (specgate_plain_ratio): plain decoding's TPOT for the learner, from this TPOT
    tally = Tally(0.0)
    estimated = embedded[:-1] + ',"specgate_plain_ratio":1.6}'
    tally.take(msgspec.json.decode(_answer(estimated), type=ChatCompletionResponse))
    assert outcome(_finished(tally.relayed(), stream=False)).plain_tpot_s == pytest.approx(0.025 * 1.6)
    assert record(_finished(tally.relayed(), stream=False)).plain_tpot_s == pytest.approx(0.025 * 1.6)  # dashboard
    assert outcome(f).plain_tpot_s is None and record(f).plain_tpot_s is None  # a real SGLang server sends none
    # what its drafts cost the sequences beside it (specgate_neighbour_s), per decode token: auto charges it
    tally = Tally(0.0)
    tally.take(msgspec.json.decode(_answer(embedded[:-1] + ',"specgate_neighbour_s":0.05}'),
                                   type=ChatCompletionResponse))
    charged = outcome(_finished(tally.relayed(), stream=False))
    assert (charged.tpot_s, charged.neighbour_tpot_s) == (0.025, pytest.approx(0.05 / 10))
    assert outcome(f).neighbour_tpot_s == 0.0
    # the load the request saw, for the dashboard's speedup per load bucket: what the learner is given too
    f = _finished(Tally(0.0).relayed(), stream=False, mean_concurrency=5.6)
    assert record(f).concurrency == outcome(f).concurrency == 6
    # n > 1 choices: one details object per choice, the first one's counts
    tally = Tally(0.0)
    tally.take(msgspec.json.decode(_answer(f"[{embedded}]"), type=ChatCompletionResponse))
    assert tally.relayed().decode_s == 0.25


def test_a_streamed_answer_keeps_the_gateways_tpot():
    """Streamed: (e2e - ttft) / (n - 1) on the gateway's clock (the path the client sees), even when the worker
    also reported its decode time; one token: no TPOT either way."""
    from gateway.stages import Relayed, outcome, record

    f = _finished(Relayed(completion_tokens=11, ttft_s=0.5, decode_s=0.25), stream=True)
    assert (f.tpot_s, f.tpot_source) == (0.15, "stream")
    assert (record(f).tpot_s, record(f).tpot_source, outcome(f).tpot_s) == (0.15, "stream", 0.15)
    assert _finished(Relayed(completion_tokens=11, decode_s=0.25), stream=True).tpot_s is None  # no content seen
    for stream in (True, False):
        one = _finished(Relayed(completion_tokens=1, ttft_s=0.5, decode_s=0.0), stream=stream)
        assert (one.tpot_s, one.tpot_source, record(one).tpot_source) == (None, None, None)
