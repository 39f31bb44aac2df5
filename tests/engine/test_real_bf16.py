"""What bf16 guarantees, measured on the real model.

In bf16 a verification forward of width k + 1 and a plain forward of width 1 round differently, so
greedy identity with plain bf16 decoding is NOT bitwise. What holds, and is asserted here:
- every property except bitwise identity (the same verification, stops and cache code runs);
- speculative and plain bf16 outputs agree up to their first divergence, and a divergence happens only at
  a near-tie: there, the bf16 target's logits (recomputed by a plain forward over the common prefix) of
  the two chosen tokens differ by at most BF16_TIE_MARGIN;
- every speculative configuration accepted drafts (with speculation off the rest would hold trivially);
- at the full size (``make test-full``), the divergence rate (sequences whose ids differ at all) is
  bounded by MAX_DIVERGED_FULL, and printed for the record.
Two sizes of the same test: ``fast`` (two prompts, 32 tokens, in ``make test``) and ``full`` (eight prompts,
16 tokens, marked ``full``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.engine.engine import Engine
from backends.engine.runner import load_model
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from tests.engine.engine_helpers import FULL_SIZE, run_all, workload_prompts

pytestmark = pytest.mark.real_model


@dataclasses.dataclass(frozen=True)
class Size:
    items: tuple[str, ...] | None  # workload items kept of the 8 (2 per slice); None keeps all
    tokens: int  # new tokens per sequence


# The fast pair, 32 tokens each, measured on a Xeon with AMX bf16: both configurations accept drafts on both
# prompts (ngram 3 and 5, the 8-layer bf16 self-draft 3 and 2: it rarely agrees with the target, hence 32
# tokens), and both diverge from plain bf16 on spec_bench/241 (at token 5), so the near-tie rule is exercised.
SIZES = {"fast": Size(items=("simple_python_0", "spec_bench/241"), tokens=32), "full": Size(items=None, tokens=16)}
# Divergence is a hardware-dependent rounding at near-ties: measured 10/16 sequences on a Xeon
# with AMX bf16 (gaps up to 0.125) and 5/16 on the machine of docs/benchmarks.md (all exact ties). 13/16
# leaves 3 sequences of headroom over the worst measured, and still fails when (nearly) every sequence
# diverges, as a verification that drifted from plain bf16 would make it.
MAX_DIVERGED_FULL = 13 / 16

BF16_TIE_MARGIN = 0.5  # logits are O(10-30); bf16 keeps 8 bits of mantissa (ulp 0.0625-0.125 there)
CONFIGS = {"ngram-k4": SpeculationParams(proposer="ngram", draft_tokens=4),
           "draft_model-k4": SpeculationParams(proposer="draft_model", draft_tokens=4)}


@pytest.fixture(scope="module")
def bf16_engine(real_model, prepared_model, real_tokenizer):
    config = dataclasses.replace(real_model.config, dtype="bfloat16")
    return Engine(config, model=load_model(str(prepared_model.path), "bfloat16"), tokenizer=real_tokenizer)


@torch.inference_mode()
def logits_after(engine, ids: list[int]) -> torch.Tensor:
    cache = engine.runner.new_cache()
    engine.runner.forward(cache, ids[:-1], keep=1)
    return engine.runner.forward(cache, ids[-1:], keep=1).logits[0]  # width 1, as plain decoding


@pytest.mark.parametrize("size", ["fast", pytest.param("full", marks=FULL_SIZE)])
def test_bf16_speculation_diverges_from_plain_only_at_near_ties(bf16_engine, real_tokenizer, capsys, size):
    tokens, items = SIZES[size].tokens, SIZES[size].items
    prompts = workload_prompts(real_tokenizer, per_slice=2, long_tokens=200, short_tokens=96)
    prompts = [p for p in prompts if items is None or p[1] in items]
    assert len(prompts) == (len(items) if items else 8)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    diverged, total, worst_gap = 0, 0, 0.0
    accepted = dict.fromkeys(CONFIGS, 0)
    for slice_name, item, ids in prompts:
        requests = [GenerateRequest(rid="plain", input_ids=ids, sampling=greedy)] + [
            GenerateRequest(rid=name, input_ids=ids, sampling=greedy, speculation=spec) for name, spec in CONFIGS.items()]
        events = run_all(bf16_engine, requests)
        plain = events["plain"][-1].output_ids
        for name in CONFIGS:
            got = events[name][-1].output_ids
            accepted[name] += events[name][-1].stats.num_correct_drafts
            total += 1
            if got == plain:
                continue
            diverged += 1
            j = next(i for i, (a, b) in enumerate(zip(got, plain)) if a != b)
            logits = logits_after(bf16_engine, list(ids) + list(plain[:j]))
            gap = float(logits.max() - logits[got[j]])
            worst_gap = max(worst_gap, gap)
            assert gap <= BF16_TIE_MARGIN, (f"{slice_name} {item} {name}: bf16 divergence at token {j} is not a "
                                            f"near-tie (logit gap {gap:.3f})")
    with capsys.disabled():
        print(f"\nbf16 greedy ({size}): {diverged}/{total} speculative sequences differ from plain bf16 "
              f"({tokens} tokens each); largest logit gap at a divergence {worst_gap:.3f}; accepted {accepted}")
    idle = [name for name, n in accepted.items() if n == 0]
    assert not idle, f"no draft accepted by {idle}: with speculation off, agreement with plain proves nothing"
    if size == "full":
        assert diverged <= MAX_DIVERGED_FULL * total, (f"{diverged}/{total} bf16 sequences diverge from plain "
                                                       f"(bound {MAX_DIVERGED_FULL:.2f})")
