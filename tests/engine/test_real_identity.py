"""Greedy identity on the real SmolLM2-135M-Instruct (fp32): speculative ids == plain decoding's.

30 prompts from ../shared/workloads (8 code, 8 tool_call, 7 prose, 7 long_context), every proposer
(ngram k in {1, 4, 8} and adaptive; draft_model k in {1, 4, 8}), with the stop condition rotating over
prompts: the length limit, a stop string, a stop token id (both picked from the plain output so they
fire, typically inside a round), and an odd max_new_tokens. Plain decoding with the same settings is
the reference, computed once per prompt; all configurations of one prompt run concurrently through
``engine.step()``. Sizes (defaults keep it to a few minutes on a 2-core CPU): SPECGATE_IDENTITY_TOKENS
(12) new tokens per request, SPECGATE_IDENTITY_PER_SLICE (8) prompts per slice. The draft_model
configurations use a 2-layer self-draft of the same target (identity cannot depend on the draft's
depth; the shallow draft keeps k = 8 affordable).
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from backends.engine.engine import Engine

from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from tests.engine.engine_helpers import run_all, workload_prompts

pytestmark = pytest.mark.real_model

TOKENS = int(os.environ.get("SPECGATE_IDENTITY_TOKENS", "12"))
PER_SLICE = int(os.environ.get("SPECGATE_IDENTITY_PER_SLICE", "8"))
CONFIGS = {
    **{f"ngram-k{k}": SpeculationParams(proposer="ngram", draft_tokens=k) for k in (1, 4, 8)},
    "ngram-adaptive": SpeculationParams(proposer="ngram", draft_tokens=8, adaptive=True),
    **{f"draft_model-k{k}": SpeculationParams(proposer="draft_model", draft_tokens=k) for k in (1, 4, 8)},
}


def stop_variant(index: int, free_ids: tuple[int, ...], free_text: str) -> SamplingParams:
    base = SamplingParams(temperature=0.0, max_new_tokens=TOKENS)
    variant = index % 4
    if variant == 1 and len(free_text) > 12:  # a stop string from the middle of the plain text
        middle = len(free_text) // 2
        return dataclasses.replace(base, stop=(free_text[middle:middle + 3],))
    if variant == 2 and len(free_ids) > 8:
        return dataclasses.replace(base, stop_token_ids=(free_ids[len(free_ids) // 2],))
    if variant == 3:
        return dataclasses.replace(base, max_new_tokens=TOKENS // 2 + 1)
    return base


@pytest.fixture(scope="module")
def engine(real_model, real_tokenizer):
    """The real engine's model with a 2-layer self-draft (shares every weight tensor)."""
    return Engine(dataclasses.replace(real_model.config, draft_layers=2), model=real_model.runner.model,
                  tokenizer=real_tokenizer)


@pytest.fixture(scope="module")
def prompts(real_tokenizer):
    prompts = workload_prompts(real_tokenizer, per_slice=PER_SLICE, long_tokens=256, short_tokens=128)
    if PER_SLICE == 8:  # 8 + 8 + 7 + 7 = 30 prompts: drop the last prose and long_context item
        prompts = [p for i, p in enumerate(prompts) if i not in (23, 31)]
    return prompts


@pytest.mark.parametrize("slice_", ["code", "tool_call", "prose", "long_context"])
def test_greedy_identity_on_workload_prompts(engine, prompts, slice_):
    real_model = engine
    prompts = [p for p in prompts if p[0] == slice_]
    assert len(prompts) >= min(PER_SLICE, 7)
    mismatches: list[str] = []
    finishes: dict[str, int] = {}
    accepted = 0
    for index, (slice_name, item, ids) in enumerate(prompts):
        free = run_all(real_model, [GenerateRequest(rid="free", input_ids=ids, sampling=SamplingParams(
            temperature=0.0, max_new_tokens=TOKENS))])["free"][-1]
        sampling = stop_variant(index, free.output_ids, free.text)
        if sampling.stop or sampling.stop_token_ids or sampling.max_new_tokens != TOKENS:
            reference = run_all(real_model, [GenerateRequest(rid="ref", input_ids=ids, sampling=sampling)])["ref"][-1]
            assert free.output_ids[:len(reference.output_ids)] == reference.output_ids
        else:
            reference = free
        finishes[reference.finish_reason.type] = finishes.get(reference.finish_reason.type, 0) + 1
        requests = [GenerateRequest(rid=name, input_ids=ids, sampling=sampling, speculation=spec)
                    for name, spec in CONFIGS.items()]
        events = run_all(real_model, requests)
        for name in CONFIGS:
            got = events[name][-1]
            accepted += got.stats.num_correct_drafts
            if (got.output_ids, got.text, got.finish_reason) != (
                    reference.output_ids, reference.text, reference.finish_reason):
                mismatches.append(f"{slice_name} {item} {name}: {got.output_ids} ({got.finish_reason}) "
                                  f"!= plain {reference.output_ids} ({reference.finish_reason})")
    assert not mismatches, "\n".join(mismatches)
    assert accepted > 0  # speculation really happened
    assert finishes.get("stop", 0) >= 1 and finishes.get("length", 0) >= 1, finishes
