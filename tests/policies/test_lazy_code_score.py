"""The gateway computes ``code_score`` only when deciding the request reads it (policies.slicing.needs_code_score):
slicing reaches a slice that tests it before an earlier slice matches, or a rule tests it. Skipping it never
changes a request's slice."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.features import RequestFeatures, features_from_openai
from policies.load import load_policy, load_policy_file
from policies.slicing import classify, needs_code_score
from replay.workloads import load_all

DEFAULT = load_policy_file(Path(__file__).resolve().parents[2] / "deploy" / "policies" / "default.yaml")
CODE_FIRST = """
version: 1
slices:
  - {name: code, when: {code_score: {gte: 0.3}}}
  - {name: long_context, when: {prompt_tokens: {gte: 512}}}
  - {name: prose}
pools: {plain: {proposer: none, workers: ["http://a:1"]}}
rules: [{name: rest, then: bypass}]
"""
RULE_READS = CODE_FIRST.replace(
    "  - {name: code, when: {code_score: {gte: 0.3}}}\n", "").replace(
    "rules: [{name: rest, then: bypass}]",
    "rules: [{name: code, when: {code_score: {gte: 0.5}}, then: bypass}, {name: rest, then: bypass}]")
POLICIES = [DEFAULT, load_policy(CODE_FIRST, "code-first.yaml"), load_policy(RULE_READS, "rule-reads.yaml")]


def unscored(**kw) -> RequestFeatures:
    return RequestFeatures(code_score=None, **kw)


def test_the_default_policy_reads_it_only_for_requests_that_reach_the_code_slice() -> None:
    assert needs_code_score(DEFAULT, unscored(prompt_tokens=40)) is True  # prose or code: the code slice decides
    assert needs_code_score(DEFAULT, unscored(prompt_tokens=40, has_tools=True)) is False  # tool_call matched first
    assert needs_code_score(DEFAULT, unscored(prompt_tokens=600)) is False  # long_context matched first
    assert needs_code_score(DEFAULT, unscored(prompt_tokens=511)) is True


def test_a_slice_before_the_match_or_any_rule_that_tests_it_needs_it() -> None:
    assert needs_code_score(POLICIES[1], unscored(prompt_tokens=600)) is True  # code is tested before long_context
    assert needs_code_score(POLICIES[2], unscored(prompt_tokens=600)) is True  # no slice tests it, a rule does
    no_reader = load_policy(CODE_FIRST.replace("  - {name: code, when: {code_score: {gte: 0.3}}}\n", ""), "n.yaml")
    assert needs_code_score(no_reader, unscored(prompt_tokens=40)) is False


def test_features_leave_it_none_only_when_not_needed() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Write a Python script. " + "x " * 1000}]}
    assert features_from_openai(body, code=partial(needs_code_score, DEFAULT)).code_score is None  # long
    assert features_from_openai(body, code=False).code_score is None
    full = features_from_openai(body)
    assert full.code_score == 0.5 and features_from_openai(body, code=partial(needs_code_score, POLICIES[1])) == full


def test_skipping_it_never_changes_a_sample_request_slice() -> None:
    skipped = 0
    for items in load_all().values():
        for item in items:
            body = item.chat_body()
            full = features_from_openai(body, repeat=False)
            for policy in POLICIES:
                lazy = features_from_openai(body, repeat=False, code=partial(needs_code_score, policy))
                assert classify(policy, lazy) == classify(policy, full), (item.id, policy)
                skipped += lazy.code_score is None
    assert skipped == 78 + 29  # the default policy: every tool call, and the long prompts


@settings(max_examples=300, deadline=None)
@given(tokens=st.integers(0, 2000), tools=st.booleans(), score=st.floats(0, 1), which=st.integers(0, 2))
def test_the_slice_is_the_same_whether_or_not_it_was_skipped(tokens: int, tools: bool, score: float, which: int) -> None:
    policy = POLICIES[which]
    lazy = unscored(prompt_tokens=tokens, has_tools=tools)
    full = RequestFeatures(prompt_tokens=tokens, has_tools=tools, code_score=score)
    if not needs_code_score(policy, lazy):
        assert classify(policy, lazy) == classify(policy, full)
