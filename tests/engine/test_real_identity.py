"""Greedy identity on the real SmolLM2-135M-Instruct (fp32): speculative ids == plain decoding's.

Prompts from the workloads (``workloads/``, or the full sets under ``$SPECGATE_WORKLOADS``): code,
tool_call, prose, long_context. Every proposer (ngram k in {1, 4, 8} and adaptive; draft_model k in {1, 4, 8}; suffix k = 8;
hybrid k = 8, fixed and adaptive), with the stop condition rotating over prompts: the
length limit, a stop string, a stop token id (both picked from the plain output so they fire, typically
inside a round), and an odd max_new_tokens. A slice's first prompt, at the length limit, runs to a long
one (Size.long_output: many rounds at k = 8, not one or two). Plain decoding with the same settings is the reference, computed once
per prompt; all configurations of one prompt run concurrently through ``engine.step()``. Every
speculative configuration must accept drafts on the prompts of each test, so a configuration that
never speculates cannot pass as "identical".

Two sizes of the same test:
- ``fast`` (``make test``): one prompt per slice in one test, the long_context one a real QMSum
  transcript of 1000+ tokens; between them the four stop variants, one long output, every configuration.
- ``full`` (``make test-full``, marked ``full``): 30 prompts (8 code, 8 tool_call, 7 prose, 7
  long_context cut to 256 tokens), one test per slice, a 64-token output in each; ``make test-full``
  runs the fast size too.
The draft_model configurations use a 2-layer self-draft of the same target (identity cannot depend on
the draft's depth; the shallow draft keeps k = 8 affordable).
"""

from __future__ import annotations

import dataclasses

import pytest

from backends.engine.engine import Engine
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from tests.engine.engine_helpers import FULL_SIZE, FrozenCosts, run_all, workload_prompts

pytestmark = pytest.mark.real_model

SLICES = ("code", "tool_call", "prose", "long_context")
SHORT_TOKENS = 128  # code, tool_call and prose prompts keep their last 128 tokens
CONFIGS = {
    **{f"ngram-k{k}": SpeculationParams(proposer="ngram", draft_tokens=k) for k in (1, 4, 8)},
    "ngram-adaptive": SpeculationParams(proposer="ngram", draft_tokens=8, adaptive=True),
    "ngram-adaptive-sglang": SpeculationParams(proposer="ngram", draft_tokens=7, adaptive=True, strategy="sglang"),
    # the self-draft matches ~4% of tokens: specgate's controller rightly stops drafting with it, so the draft
    # model's per-round path runs here under vLLM's table (always k = 4); tests/engine/test_stops.py runs beta on it
    "draft_model-adaptive-vllm": SpeculationParams(proposer="draft_model", draft_tokens=4, adaptive=True,
                                                   strategy="vllm", k_by_batch=((1, 4),)),
    **{f"draft_model-k{k}": SpeculationParams(proposer="draft_model", draft_tokens=k) for k in (1, 4, 8)},
    "suffix-k8": SpeculationParams(proposer="suffix", draft_tokens=8),
    "hybrid-k8": SpeculationParams(proposer="hybrid", draft_tokens=8),
    "hybrid-adaptive": SpeculationParams(proposer="hybrid", draft_tokens=8, adaptive=True),
}


@dataclasses.dataclass(frozen=True)
class Size:
    per_slice: int  # prompts per slice (the full set drops the last prose and long_context item: 30)
    tokens: int  # max_new_tokens of most requests
    long_output: int  # max_new_tokens of a slice's first prompt when it stops at the length limit
    long_context: int  # long_context prompts keep their last this many tokens (QMSum: about 0.94x as many)


SIZES = {"fast": Size(per_slice=1, tokens=12, long_output=48, long_context=1100),  # QMSum: 1037 tokens
         "full": Size(per_slice=8, tokens=12, long_output=64, long_context=256)}


def request_sampling(index: int, first_of_slice: bool, size: Size, plain):
    """Prompt ``index``'s stop condition, rotating, and the stop-free plain output a stop was picked from.

    ``plain(sampling)`` decodes plainly: stop strings and stop ids come from its output, so they fire.
    """
    base = SamplingParams(temperature=0.0, max_new_tokens=size.tokens)
    variant = index % 4
    if variant == 0:  # the length limit; long for a slice's first prompt
        return (dataclasses.replace(base, max_new_tokens=size.long_output) if first_of_slice else base), None
    if variant == 3:
        return dataclasses.replace(base, max_new_tokens=size.tokens // 2 + 1), None
    free = plain(base)
    if variant == 1 and len(free.text) > 12:  # a stop string from the middle of the plain text
        middle = len(free.text) // 2
        return dataclasses.replace(base, stop=(free.text[middle:middle + 3],)), free
    if variant == 2 and len(free.output_ids) > 8:
        return dataclasses.replace(base, stop_token_ids=(free.output_ids[len(free.output_ids) // 2],)), free
    return base, free


@pytest.fixture(scope="module")
def engine(real_model, real_tokenizer):
    """The real engine's model with a 2-layer self-draft (shares every weight tensor) and a fixed cost model
    (FrozenCosts), so the adaptive configurations' rounds do not depend on machine load."""
    engine = Engine(dataclasses.replace(real_model.config, draft_layers=2), model=real_model.runner.model,
                    tokenizer=real_tokenizer)
    engine.costs = FrozenCosts()
    return engine


def size_prompts(tokenizer, size: Size) -> list[tuple[str, str, tuple[int, ...]]]:
    prompts = workload_prompts(tokenizer, per_slice=size.per_slice, long_tokens=size.long_context,
                               short_tokens=SHORT_TOKENS)
    if size.per_slice == 8:  # 8 + 8 + 7 + 7 = 30 prompts: drop the last prose and long_context item
        prompts = [p for i, p in enumerate(prompts) if i not in (23, 31)]
    return prompts


@pytest.mark.parametrize("size_name, slices", [
    ("fast", SLICES),
    *[pytest.param("full", (slice_,), marks=FULL_SIZE, id=f"full-{slice_}") for slice_ in SLICES],
], ids=lambda v: "all" if v == SLICES else None)
def test_greedy_identity_on_workload_prompts(engine, real_tokenizer, size_name, slices):
    size = SIZES[size_name]
    prompts = [p for p in size_prompts(real_tokenizer, size) if p[0] in slices]
    assert {p[0] for p in prompts} == set(slices) and len(prompts) >= size.per_slice * len(slices) - 1
    if size_name == "fast":
        assert max(len(ids) for _, _, ids in prompts) >= 1000, "the fast set needs a long-context prompt"
    mismatches: list[str] = []
    finishes: dict[str, int] = {}
    accepted = dict.fromkeys(CONFIGS, 0)
    for index, (slice_name, item, ids) in enumerate(prompts):
        def plain(sampling: SamplingParams):
            return run_all(engine, [GenerateRequest(rid="plain", input_ids=ids, sampling=sampling)])["plain"][-1]

        first_of_slice = index == 0 or prompts[index - 1][0] != slice_name
        sampling, free = request_sampling(index, first_of_slice, size, plain)
        reference = plain(sampling) if free is None or sampling.stop or sampling.stop_token_ids else free
        if free is not None:  # a stop only cuts plain decoding short
            assert free.output_ids[:len(reference.output_ids)] == reference.output_ids
        finishes[reference.finish_reason.type] = finishes.get(reference.finish_reason.type, 0) + 1
        requests = [GenerateRequest(rid=name, input_ids=ids, sampling=sampling, speculation=spec)
                    for name, spec in CONFIGS.items()]
        events = run_all(engine, requests)
        for name in CONFIGS:
            got = events[name][-1]
            accepted[name] += got.stats.num_correct_drafts
            if (got.output_ids, got.text, got.finish_reason) != (
                    reference.output_ids, reference.text, reference.finish_reason):
                mismatches.append(f"{slice_name} {item} {name}: {got.output_ids} ({got.finish_reason}) "
                                  f"!= plain {reference.output_ids} ({reference.finish_reason})")
    assert not mismatches, "\n".join(mismatches)
    idle = [name for name, n in accepted.items() if n == 0]
    assert not idle, f"{slices}: no draft accepted by {idle} (identity then proves nothing about speculation)"
    assert finishes.get("stop", 0) >= 1 and finishes.get("length", 0) >= 1, finishes
