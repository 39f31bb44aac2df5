"""Stops cut the committed tokens exactly where plain decoding stops, even in the middle of a round;
streamed text never retracts. Tiny random model, greedy, so plain decoding is the exact reference."""

from __future__ import annotations

import dataclasses

import pytest

from backends.engine.config import EngineConfig
from backends.engine.engine import Engine
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from tests.engine.engine_helpers import RoundLog, make_tiny_engine, run_all

PROMPT = (5, 6, 7, 5, 6, 7, 5, 6)  # the seeded tiny model falls into a loop: n-gram drafts get accepted
# PROMPT and the first COPIED tokens of its greedy output: the output then goes on with spans (the free run's
# positions 11-16) that the prompt holds but the output does not yet, so n-gram and suffix drafts of them are
# accepted and a stop token among them first appears inside an accepted round
COPIED = 19
SPECS = [SpeculationParams(proposer="ngram", draft_tokens=8), SpeculationParams(proposer="ngram", draft_tokens=4),
         SpeculationParams(proposer="draft_model", draft_tokens=4),
         SpeculationParams(proposer="draft_model", draft_tokens=7),
         SpeculationParams(proposer="ngram", draft_tokens=8, adaptive=True),
         SpeculationParams(proposer="ngram", draft_tokens=7, adaptive=True, strategy="sglang"),
         SpeculationParams(proposer="draft_model", draft_tokens=5, adaptive=True),
         SpeculationParams(proposer="draft_model", draft_tokens=6, adaptive=True, strategy="vllm",
                           k_by_batch=((1, 5), (2, 3))),
         SpeculationParams(proposer="suffix", draft_tokens=8),
         SpeculationParams(proposer="hybrid", draft_tokens=8),
         SpeculationParams(proposer="hybrid", draft_tokens=8, adaptive=True)]
SPEC_IDS = ["ngram8", "ngram4", "draft4", "draft7", "adaptive8", "sglang7", "beta-draft5", "vllm-draft6", "suffix8",
            "hybrid8", "hybrid-adaptive8"]


@pytest.fixture(scope="module")
def engine(real_tokenizer):
    """Tiny engine whose draft model is a second copy of the target ("perfect draft"): greedy drafts
    are then accepted, so rounds commit up to k + 1 tokens and stops land inside rounds."""
    engine = make_tiny_engine(real_tokenizer, seed=3)
    engine.slot_maker._draft_runner = engine.runner.truncated(engine.runner.layers)
    return engine


def plain_run(engine, prompt):
    out = run_all(engine, [GenerateRequest(rid="free", input_ids=prompt,
                                           sampling=SamplingParams(temperature=0.0, max_new_tokens=40))])
    return out["free"][-1]


@pytest.fixture(scope="module")
def free_run(engine):
    """Plain greedy output with no stop but the length: the text stops are chosen from."""
    return plain_run(engine, PROMPT)


@pytest.fixture(scope="module")
def copy_run(engine, free_run):
    """The prompt that holds spans of its own continuation (COPIED), and its plain greedy output."""
    prompt = (*PROMPT, *free_run.output_ids[:COPIED])
    run = plain_run(engine, prompt)
    assert run.output_ids[:10] == free_run.output_ids[COPIED:COPIED + 10]  # the free run goes on
    return prompt, run


def assert_streaming_never_retracts(events) -> None:
    texts = [e.text for e in events]
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before), (before, after)
    ids = [e.output_ids for e in events]
    for before, after in zip(ids, ids[1:]):
        assert after[:len(before)] == before
    assert sum(len(e.new_token_ids) for e in events) == len(events[-1].output_ids)
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]


def compare(engine, sampling: SamplingParams, spec: SpeculationParams, prompt=PROMPT, monkeypatch=None):
    """Run plain and speculative side by side; assert identical ids, text and finish; return both."""
    plain = GenerateRequest(rid="plain", input_ids=prompt, sampling=sampling)
    speculative = GenerateRequest(rid="spec", input_ids=prompt, sampling=sampling, speculation=spec)
    events = run_all(engine, [plain, speculative])
    for evs in events.values():
        assert_streaming_never_retracts(evs)
    want, got = events["plain"][-1], events["spec"][-1]
    assert got.output_ids == want.output_ids
    assert got.text == want.text
    assert got.finish_reason == want.finish_reason
    return want, got


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **{"max_new_tokens": 40, **kw})


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_stop_token_id_cuts_mid_round(engine, free_run, copy_run, spec, monkeypatch):
    """Every proposer, fixed or adaptive, has a stop that fires inside a round whose drafts were accepted:
    the perfect draft model on PROMPT, n-gram and suffix drafts on the prompt that holds spans of its own
    continuation (the n-gram proposer drafts only tokens already in the context, so on PROMPT a stop token's
    first occurrence never falls inside one of its accepted rounds)."""
    log = RoundLog(monkeypatch)
    cut_mid_round = []
    for prompt, run in ((PROMPT, free_run), copy_run):
        for position in range(3, 30, 2):
            token = run.output_ids[position]
            want, got = compare(engine, greedy(stop_token_ids=(token,)), spec, prompt=prompt)
            first = run.output_ids.index(token)
            assert got.output_ids == run.output_ids[:first + 1]
            assert got.finish_reason.to_dict() == {"type": "stop", "matched": token}
            last = log.of(got)[-1]
            if last.committed < last.accepted + 1:
                cut_mid_round.append((len(prompt), first))
    # the engine's costs are fixed (make_tiny_engine), so specgate's controller rounds are reproducible too
    assert cut_mid_round, "no stop fired in the middle of an accepted round: the test lost its point"


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_stop_strings_trim_and_no_stop_trim(engine, free_run, spec):
    text = free_run.text
    for start in (len(text) // 4, len(text) // 2):
        stop = text[start:start + 3]
        want, got = compare(engine, greedy(stop=(stop, "never-seen")), spec)
        assert got.finish_reason.to_dict() == {"type": "stop", "matched": stop}
        assert got.text == text[:text.index(stop)]
        _, kept = compare(engine, greedy(stop=(stop,), no_stop_trim=True), spec)
        assert kept.text == text[:text.index(stop) + len(stop)]
        assert kept.output_ids == got.output_ids


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_max_new_tokens_cuts_exactly(engine, free_run, spec, max_new_tokens):
    _, got = compare(engine, greedy(max_new_tokens=max_new_tokens), spec)
    assert got.output_ids == free_run.output_ids[:max_new_tokens]
    assert got.finish_reason.to_dict() == {"type": "length", "length": max_new_tokens}


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_min_new_tokens_masks_stop_tokens_identically(engine, free_run, spec):
    token = free_run.output_ids[2]
    for min_new in (1, 3, 6):
        _, got = compare(engine, greedy(stop_token_ids=(token,), min_new_tokens=min_new), spec)
        assert len(got.output_ids) >= min_new
        assert token not in got.output_ids[:min_new - 1]


def test_eos_and_ignore_eos(real_tokenizer, engine, free_run):
    """EOS stops like a stop token (reported as its id); ignore_eos decodes through it to the length."""
    eos = free_run.output_ids[9]
    model = engine.runner.model
    model.config.eos_token_id = eos  # the engine reads EOS from the model config at construction
    try:
        eos_engine = Engine(dataclasses.replace(engine.config), model=model, tokenizer=real_tokenizer)
    finally:
        model.config.eos_token_id = None
    assert eos in eos_engine.eos_ids
    eos_engine.slot_maker._draft_runner = engine.slot_maker._draft_runner
    first = free_run.output_ids.index(eos)
    for spec in SPECS:
        _, got = compare(eos_engine, greedy(), spec)
        assert got.output_ids == free_run.output_ids[:first + 1]
        assert got.finish_reason.to_dict() == {"type": "stop", "matched": eos}
        _, through = compare(eos_engine, greedy(ignore_eos=True, max_new_tokens=30), spec)
        assert through.output_ids == free_run.output_ids[:30]
        assert through.finish_reason.type == "length"


def test_partial_stop_string_is_held_back_while_streaming(engine, free_run):
    """A stop string that never completes is held back only while it could still complete."""
    text = free_run.text
    stop = text[10:14] + "\x00"  # its first 4 characters appear, the full string never does
    evs = run_all(engine, [GenerateRequest(rid="s", input_ids=PROMPT, sampling=greedy(stop=(stop,)),
                                           speculation=SPECS[0])])["s"]
    assert_streaming_never_retracts(evs)
    assert evs[-1].text == text and evs[-1].finish_reason.type == "length"
    assert all(not e.text.endswith(stop[:4]) for e in evs[:-1])


def test_engine_config_defaults_are_fp32():
    assert EngineConfig(model_path="x").dtype == "float32"
