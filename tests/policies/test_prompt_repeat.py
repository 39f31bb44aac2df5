"""prompt_repeat: exact values on constructed prompts, the definition it implements, bounds, the features the
gateway computes, and slice/rule conditions on it (load errors are in test_load_errors.py)."""

from __future__ import annotations

import re

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.decide import decide, explain
from policies.features import RequestFeatures, features_from_openai, prompt_repeat, reads_prompt_repeat
from policies.load import load_policy
from policies.slicing import classify
from policies.snapshot import PoolState, Snapshot, SnapshotData

WORDS = re.compile(r"\w+|[^\w\s]")
UNIQUE = "The quick brown fox jumps over the lazy dog near a quiet river bank."
# 6 tokens (Hello , world . Hi !); twice: 12 tokens, 9 four-gram positions, the last 3 seen before
PHRASE = "Hello, world. Hi!"


def reference(text: str, n: int = 4) -> float:
    """The definition, written the slow way: positions whose 4-gram was already seen, over positions."""
    words = WORDS.findall(text[-8000:])
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if len(grams) < 2:
        return 0.0
    repeated = sum(1 for i, g in enumerate(grams) if g in grams[:i])
    return round(repeated / len(grams), 4)


def test_no_repetition_is_zero() -> None:
    assert prompt_repeat(UNIQUE) == 0.0  # 'the' occurs twice, but no 4-gram does
    assert prompt_repeat("def add(a, b):\n    return a + b") == 0.0


def test_a_text_repeated_twice_has_the_share_computed_by_hand() -> None:
    assert prompt_repeat(f"{PHRASE} {PHRASE}") == round(3 / 9, 4) == 0.3333
    # m distinct tokens twice: 2m - 3 positions, the second copy's m - 3 of them repeats
    m = len(WORDS.findall(UNIQUE))
    assert m == 15 and prompt_repeat(f"{UNIQUE}\n{UNIQUE}") == round((m - 3) / (2 * m - 3), 4) == 0.4444
    # whitespace does not matter, only word and punctuation tokens do
    assert prompt_repeat(f"{PHRASE}\n\n   {PHRASE}") == prompt_repeat("Hello,world.Hi!Hello,world.Hi!") == 0.3333


def test_short_texts_are_zero_and_five_tokens_are_the_minimum() -> None:
    for text in ("", "   \n\t", "a", "a a a a", "Hi!!"):  # under 5 tokens: fewer than 2 four-gram positions
        assert prompt_repeat(text) == 0.0
    assert prompt_repeat("a a a a a") == 0.5  # 2 positions, the second repeats the first
    assert prompt_repeat(" ".join(["x"] * 1000)) == round(996 / 997, 4) == 0.999


def test_only_the_last_8000_characters_count() -> None:
    filler = " ".join(f"w{i}" for i in range(2000))  # 10,889 characters, no repeated 4-gram
    assert len(filler) > 8000 and prompt_repeat(filler) == 0.0
    assert prompt_repeat(f"{PHRASE} {PHRASE} {filler}") == 0.0  # the repetition is before the sample
    assert prompt_repeat(f"{filler} {PHRASE} {PHRASE}") > 0.0


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400) | st.lists(st.sampled_from(["a", "b", "c", ",", "x y", "\n"]), max_size=300).map(" ".join))
def test_matches_the_definition_and_stays_in_bounds(text: str) -> None:
    value = prompt_repeat(text)
    assert 0.0 <= value <= 1.0
    assert value == reference(text)


def test_features_from_openai_carry_it_from_the_prompt_text() -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": PHRASE},
                                       {"role": "user", "content": [{"type": "text", "text": PHRASE}]}]}
    f = features_from_openai(body)
    assert f.prompt_repeat == prompt_repeat(f"{PHRASE}\n{PHRASE}") == 0.3333
    assert features_from_openai({"prompt": UNIQUE}).prompt_repeat == 0.0
    assert RequestFeatures().prompt_repeat == 0.0
    # serialised with the other features (explain --json, trace records) and read back
    encoded = msgspec.json.encode(f)
    assert b'"prompt_repeat":0.3333' in encoded and msgspec.json.decode(encoded, type=RequestFeatures) == f
    assert msgspec.json.decode(b'{"code_score": 0.5}', type=RequestFeatures).prompt_repeat == 0.0


POLICY = """
version: 1
slices:
  - {name: repetitive, when: {prompt_repeat: {gte: 0.25}}}
  - {name: between, when: {prompt_repeat: {gt: 0.0, lt: 0.25}}}
  - {name: prose}
pairs:
  p: {target: {model: m}, draft: {kind: ngram}}
pools:
  plain: {proposer: none, workers: ["http://a:1"]}
  ngram: {proposer: ngram, draft_tokens: 8, pair: p, workers: ["http://b:1"]}
rules:
  - name: copyable
    when: {prompt_repeat: {gte: 0.1}, slice: [repetitive, between]}
    then: {pool: ngram, draft_tokens: 8}
  - {name: rest, then: bypass}
"""


def chat(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def test_a_condition_routes_repetitive_and_non_repetitive_prompts_apart() -> None:
    policy = load_policy(POLICY, "p.yaml")
    snap = Snapshot(SnapshotData(pools={"plain": PoolState(healthy=True, pair_verified=True),
                                        "ngram": PoolState(healthy=True, pair_verified=True)}))
    repetitive = features_from_openai(chat(f"Rewrite this, keeping it the same: {UNIQUE}\n{UNIQUE}"))
    fresh = features_from_openai(chat(UNIQUE))
    assert repetitive.prompt_repeat >= 0.25 and fresh.prompt_repeat == 0.0
    assert classify(policy, repetitive) == ("repetitive", 0) and classify(policy, fresh) == ("prose", 2)
    assert classify(policy, RequestFeatures(prompt_repeat=0.1)) == ("between", 1)
    assert classify(policy, RequestFeatures(prompt_repeat=0.0)) == ("prose", 2)  # gt 0.0 is strict
    assert (decide(policy, repetitive, snap).pool, decide(policy, fresh, snap).bypass) == ("ngram", True)
    trace = explain(policy, RequestFeatures(prompt_repeat=0.05), snap)
    assert (trace.slice, trace.decision.rule, trace.rules[0].failed) == ("between", "rest", "prompt_repeat >= 0.1")
    assert trace.features.prompt_repeat == 0.05


def test_it_is_computed_only_when_asked_and_a_policy_says_whether_it_reads_it() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": f"{PHRASE} {PHRASE}"}]}
    skipped = features_from_openai(body, repeat=False)
    assert skipped.prompt_repeat is None
    assert msgspec.structs.replace(skipped, prompt_repeat=0.3333) == features_from_openai(body)
    only_slices = POLICY.replace("prompt_repeat: {gte: 0.1}, ", "")
    only_rule = only_slices.replace("when: {prompt_repeat: {gte: 0.25}}", "when: {code_score: {gte: 0.3}}").replace(
        "when: {prompt_repeat: {gt: 0.0, lt: 0.25}}", "when: {has_tools: true}").replace(
        "slice: [repetitive, between]", "prompt_repeat: {gte: 0.1}")
    neither = only_rule.replace("prompt_repeat: {gte: 0.1}", "code_score: {gte: 0.1}")
    assert "prompt_repeat" not in neither and only_rule.count("prompt_repeat") == 1
    assert [reads_prompt_repeat(load_policy(text, "p.yaml")) for text in (POLICY, only_slices, only_rule, neither)
            ] == [True, True, True, False]
    # an auto rule learns per prompt_repeat band (policies/auto.py), unless the bands are switched off
    learning = neither.replace("then: bypass}", "then: auto}")
    assert reads_prompt_repeat(load_policy(learning, "p.yaml"))
    assert not reads_prompt_repeat(load_policy(learning + "learning: {repeat_bands: []}\n", "p.yaml"))
    pinned = neither.replace("then: bypass}", "then: {pools: [ngram]}}")
    assert reads_prompt_repeat(load_policy(pinned, "p.yaml"))
