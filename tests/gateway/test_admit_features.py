"""What admission computes: ``prompt_repeat`` (up to ~1 ms on a long prompt) only for a policy that reads it or
a request recorded in a trace (a trace keeps every feature for replaying other policies); ``code_score`` (up to
~0.3 ms) only when deciding the request reads it, or for a recorded request; every other feature always."""

from __future__ import annotations

import time

import msgspec

from gateway.lifecycle import admit
from gateway.requests import ChatRequest, parse_body
from gateway.settings import GatewaySettings
from gateway.stages import Arrival
from gateway.state import GatewayState
from policies.features import features_from_openai

POLICY = """
version: 1
slices:
  - {name: code, when: {code_score: {gte: 0.3}}}
  - {name: prose}
pools:
  plain: {proposer: none, workers: ["http://127.0.0.1:9"]}
rules:
  - {name: rest, then: bypass}
"""
TEXT = "Hello, world. Hi! Hello, world. Hi!"
RAW = b'{"model": "m", "messages": [{"role": "user", "content": "' + TEXT.encode() + b'"}]}'


def _admitted(tmp_path, policy: str, trace: bool = False, raw: bytes = RAW):
    path = tmp_path / "p.yaml"
    path.write_text(policy)
    state = GatewayState(GatewaySettings(policy_path=str(path),
                                         trace_path=str(tmp_path / "t.jsonl") if trace else None))
    body, parsed = parse_body(raw, ChatRequest)
    assert isinstance(parsed, ChatRequest)
    arrival = Arrival(request_id="0" * 32, endpoint="chat", t0=time.perf_counter())
    return admit(state, arrival, state.active, "default", body, parsed, {})


def test_prompt_repeat_is_skipped_when_no_condition_reads_it(tmp_path):
    a = _admitted(tmp_path, POLICY)
    assert a.trace_ids is False and a.features.prompt_repeat is None
    full = features_from_openai(a.body, route="default")
    assert full.prompt_repeat == 0.3333 and a.features == msgspec.structs.replace(full, prompt_repeat=None)


def test_prompt_repeat_is_computed_for_a_policy_that_reads_it(tmp_path):
    policy = POLICY.replace("- {name: rest, then: bypass}",
                            "- {name: copy, when: {prompt_repeat: {gte: 0.2}}, then: bypass}\n  - {name: rest, then: bypass}")
    assert _admitted(tmp_path, policy).features.prompt_repeat == 0.3333


def test_prompt_repeat_is_computed_for_a_request_recorded_in_a_trace(tmp_path):
    a = _admitted(tmp_path, POLICY, trace=True)
    assert a.trace_ids is True and a.features.prompt_repeat == 0.3333


LONG_FIRST = POLICY.replace("  - {name: code,", "  - {name: long_context, when: {prompt_tokens: {gte: 512}}}\n  - {name: code,")
LONG = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"def f(x): return x; " * 120 + b'"}]}'


def test_code_score_is_skipped_for_a_request_sliced_before_any_condition_reads_it(tmp_path):
    a = _admitted(tmp_path, LONG_FIRST, raw=LONG)
    assert a.features.code_score is None and a.features.prompt_tokens == 667
    full = features_from_openai(a.body, route="default", repeat=False)
    assert full.code_score == 0.45 and a.features == msgspec.structs.replace(full, code_score=None)


def test_code_score_is_computed_when_the_slices_reach_it_or_the_request_is_recorded(tmp_path):
    assert _admitted(tmp_path, LONG_FIRST).features.code_score == 0.1029  # short: the code slice decides
    assert _admitted(tmp_path, POLICY, raw=LONG).features.code_score == 0.45  # code tested first
    assert _admitted(tmp_path, LONG_FIRST, trace=True, raw=LONG).features.code_score == 0.45
