"""Hypothesis property tests of the round invariants, on a tiny random model through the real engine.

Checked on every round of every generated request:
- accepted <= k, and committed == accepted + 1 except in the final round, where a stop may cut it;
- at every target forward, the cache holds exactly the committed context minus its last token, and
  the round feeds that last token followed by the drafts (so rejected drafts of earlier rounds are never
  in the context of a later step: the cache is always a prefix of the committed context);
- after every step, the target cache length == prompt_len + output_len - 1, and its key/value tensors
  (every layer) equal those of a fresh prefill of the committed context minus its last token; the draft
  model's cache equals a fresh prefill of the tokens it records as fed (so a rollback that crops the
  bookkeeping but leaves stale or corrupted keys/values fails here, not only a wrong length);
- the draft model's own cache, when the target verifies, holds the committed context plus drafts
  1..k-1 (its rollback re-synced it to the committed prefix after the previous round's rejections);
- greedy speculative output == plain output, token for token.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.engine.sequence import Status
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from tests.engine.engine_helpers import CacheRecorder, RoundLog, check_caches, make_tiny_engine, run_all


@pytest.fixture(scope="module")
def engine(real_tokenizer):
    return make_tiny_engine(real_tokenizer, seed=1)


def check_rounds(rounds, finish) -> None:
    assert rounds
    for i, r in enumerate(rounds):
        assert 0 <= r.accepted <= r.k
        assert r.bonus == (r.accepted == r.k)
        if i < len(rounds) - 1:
            assert r.committed == r.accepted + 1
        else:
            assert 1 <= r.committed <= r.accepted + 1
            if r.committed < r.accepted + 1:
                assert finish.type in ("stop", "length")


def install_cache_checks(engine, errors: list[str]):
    """Record every target and draft forward; on each, assert the cache-prefix invariant."""

    def sequence_of(cache):
        for rid, slot in engine._slots.items():
            if slot.cache is cache:
                return engine.scheduler.find(rid), slot
        raise AssertionError("forward on a cache that belongs to no running sequence")

    def on_target_forward(cache, before, fed):
        seq, slot = sequence_of(cache)
        if seq.status is Status.PREFILL:
            if before + fed != list(seq.prompt_ids[:len(before) + len(fed)]):
                errors.append(f"prefill fed something other than the prompt: {before + fed}")
            return
        context = seq.context
        if before != context[:-1] or fed[0] != context[-1]:
            errors.append(f"round cache {before} + fed {fed} vs committed context {context}")
        drafts = fed[1:]
        proposer = slot.proposer
        if drafts and proposer is not None and proposer.name == "draft_model":
            held = draft_recorder.contents(proposer.cache)
            if held != context + drafts[:-1]:
                errors.append(f"draft cache {held} vs committed {context} + drafts {drafts[:-1]}")

    target_recorder = CacheRecorder(engine.runner, on_target_forward)
    draft_recorder = CacheRecorder(engine.draft_runner)
    return target_recorder, draft_recorder


WORDS = st.sampled_from([28, 253, 314, 327, 338, 355, 411, 506, 2683, 7018])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(WORDS, min_size=1, max_size=24),
    proposer=st.sampled_from(["ngram", "draft_model", "suffix"]),
    k=st.integers(1, 8),
    adaptive=st.booleans(),
    temperature=st.sampled_from([0.0, 0.0, 0.8, 1.5]),
    top_k=st.sampled_from([-1, 3]),
    penalty=st.sampled_from([{}, {"repetition_penalty": 1.3}, {"frequency_penalty": 0.5, "presence_penalty": 0.3},
                             {"min_new_tokens": 3}]),
    max_new_tokens=st.integers(1, 20),
    stop_at=st.none() | st.integers(0, 19),
    seed=st.integers(0, 2**31),
)
def test_round_invariants(engine, monkeypatch, prompt, proposer, k, adaptive, temperature, top_k, penalty,
                          max_new_tokens, stop_at, seed):
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                              sampling_seed=seed, **penalty)
    plain = GenerateRequest(rid="plain", input_ids=tuple(prompt), sampling=sampling)
    reference = run_all(engine, [plain])["plain"][-1]
    if stop_at is not None and stop_at < len(reference.output_ids):
        stop_token = reference.output_ids[stop_at]
        sampling = dataclasses.replace(sampling, stop_token_ids=(stop_token,))
        reference = run_all(engine, [GenerateRequest(rid="plain", input_ids=tuple(prompt), sampling=sampling)])
        reference = reference["plain"][-1]
    log = RoundLog(monkeypatch)
    errors: list[str] = []
    recorders = install_cache_checks(engine, errors)
    spec = GenerateRequest(rid="spec", input_ids=tuple(prompt), sampling=sampling,
                           speculation=SpeculationParams(proposer=proposer, draft_tokens=k, adaptive=adaptive))
    events = []
    try:
        engine.submit(spec, events.append)
        while engine.step():
            check_caches(engine)
            assert not errors, errors[0]
    finally:
        for recorder in recorders:
            recorder.close()
    assert not errors, errors[0]
    out = events[-1]
    assert out.finished and not engine.scheduler.running and not engine._slots
    rounds = log.of(out)
    check_rounds(rounds, out.finish_reason)
    assert sum(r.committed for r in rounds) == len(out.output_ids) <= max_new_tokens
    if temperature == 0.0:
        assert out.output_ids == reference.output_ids
        assert out.finish_reason == reference.finish_reason
