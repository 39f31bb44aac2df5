"""A sampled answer resumed mid-way keeps the target's distribution after the seam (gateway/resume.py: the
continuation is the prompt's ids + the ids already sent, served by another worker, possibly another pool).

Predeclared procedure, fixed N and seeds, on the real SmolLM2 at temperature 1.0 with top_k = 20, after a
repetitive prompt: arm ``uninterrupted``, N = 200 answers of 3 tokens (plain decoding); arm ``resumed``, N = 200
answers whose first token comes from one request (plain) and whose 2nd and 3rd from a continuation fed the prompt's
ids + that token, served with n-gram drafts (another pool) and another seed. The project's per-position chi-square
(``gateway.gates.judge.homogeneity``: tokens seen fewer than 5 times pooled) compares the two arms at every
position; reject at alpha = 0.001. A continuation that lost the prefix (fed the prompt alone) fails it: its
2nd token is drawn from the first token's distribution (checked once, by hand, when this test was written).
The seeds are in the failure message."""

from __future__ import annotations

import pytest

from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from gateway.gates.judge import homogeneity
from tests.engine.engine_helpers import run_all

pytestmark = pytest.mark.real_model

ALPHA, N, SEAM, LENGTH = 1e-3, 200, 1, 3
SEEDS = {"uninterrupted": 424_000, "first": 425_000, "continuation": 426_000}
PROMPT_TEXT = "1, 2, 3, 1, 2, 3, 1, 2"


def sampling(tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=20, max_new_tokens=tokens, ignore_eos=True, sampling_seed=seed)


def outputs(engine, prompts: list[tuple[int, ...]], tokens: int, seed: int, spec: SpeculationParams
            ) -> list[tuple[int, ...]]:
    requests = [GenerateRequest(rid=f"{seed}-{i}", input_ids=p, sampling=sampling(tokens, seed + i), speculation=spec)
                for i, p in enumerate(prompts)]
    events = run_all(engine, requests)
    return [events[r.rid][-1].output_ids for r in requests]


def test_answers_resumed_at_a_fixed_token_keep_the_targets_distribution(real_model, real_tokenizer):
    prompt = tuple(real_tokenizer.encode(PROMPT_TEXT))
    plain, ngram = SpeculationParams(proposer="none"), SpeculationParams(proposer="ngram", draft_tokens=2)
    whole = outputs(real_model, [prompt] * N, LENGTH, SEEDS["uninterrupted"], plain)
    sent = outputs(real_model, [prompt] * N, SEAM, SEEDS["first"], plain)
    rest = outputs(real_model, [prompt + s for s in sent], LENGTH - SEAM, SEEDS["continuation"], ngram)
    resumed = [s + r for s, r in zip(sent, rest)]
    assert all(len(a) == LENGTH for a in whole + resumed)
    p, positions = homogeneity([list(a) for a in resumed], [list(a) for a in whole])
    assert positions == LENGTH, f"only {positions} positions testable"
    assert p is not None and p > ALPHA, (f"resumed vs uninterrupted: smallest per-position p = {p:.2e}; "
                                         f"seeds {SEEDS}, N = {N}")
