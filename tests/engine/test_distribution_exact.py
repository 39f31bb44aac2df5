"""Distribution preservation against an exactly enumerated target distribution.

A tiny random model with a 5-token vocabulary: every 3-token continuation's probability under the
target (with the request's temperature and repetition penalty) is enumerated exactly from 31 forward
passes. Speculative sampling through the real engine (n-gram drafts with one-hot q, and the
layer-truncated draft model with its own q) must reproduce it.

Predeclared procedure: N = 1500 sequences per proposer, seeds base_seed + i; bins with expected count
< 5 merged into one; Pearson chi-square goodness of fit, reject at alpha = 0.001.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from backends.engine.config import EngineConfig
from backends.engine.engine import Engine
from backends.engine.sampling import PenaltyState, probs_from_logits, process_logits
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from tests.engine.engine_helpers import FrozenCosts, run_all, tiny_llama

VOCAB, LENGTH, N, ALPHA, BASE_SEED = 5, 3, 1500, 1e-3, 424242
PROMPT = (1, 2, 3, 1, 2)
PARAMS = SamplingParams(temperature=0.9, repetition_penalty=1.2, max_new_tokens=LENGTH, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(real_tokenizer):
    model = tiny_llama(vocab=VOCAB, seed=11, logit_scale=8.0)
    engine = Engine(EngineConfig(model_path="<tiny>", calibrate=False, draft_layers=1), model=model,
                    tokenizer=real_tokenizer)
    engine.costs = FrozenCosts()  # hybrid's adaptive rule must draft whatever this machine's load (a CI run's
    return engine                 # live costs once priced every draft out: 4 drafted in 1500 requests)


@torch.inference_mode()
def exact_distribution(engine: Engine) -> dict[tuple[int, ...], float]:
    """P(x1..xL | prompt) = prod_t p(x_t | prompt, x_<t), each p processed exactly as the engine does."""
    model = engine.runner.model

    def step_probs(prefix: tuple[int, ...]) -> torch.Tensor:
        logits = model(input_ids=torch.tensor([PROMPT + prefix])).logits[0, -1:].float()
        state = PenaltyState.create(PROMPT, VOCAB)
        state.commit(list(prefix))
        probs = probs_from_logits(process_logits(logits, PARAMS, state, [], frozenset()), PARAMS)[0].double()
        return probs / probs.sum()  # float32 rows sum to 1 only within ~1e-7

    table = {prefix: step_probs(prefix) for n in range(LENGTH) for prefix in itertools.product(range(VOCAB), repeat=n)}
    dist = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        prob = 1.0
        for t in range(LENGTH):
            prob *= float(table[seq[:t]][seq[t]])
        dist[seq] = prob
    return dist


def chi_square(counts: dict, dist: dict, n: int) -> float:
    observed, expected, rest_obs, rest_exp = [], [], 0, 0.0
    for seq, prob in dist.items():
        if prob * n >= 5:
            observed.append(counts.get(seq, 0))
            expected.append(prob * n)
        else:
            rest_obs += counts.get(seq, 0)
            rest_exp += prob * n
    observed.append(rest_obs)
    expected.append(rest_exp)
    return chisquare(observed, expected).pvalue


@pytest.mark.parametrize("spec", [
    SpeculationParams(proposer="none"),
    SpeculationParams(proposer="ngram", draft_tokens=2),
    SpeculationParams(proposer="draft_model", draft_tokens=2),
    SpeculationParams(proposer="suffix", draft_tokens=2),  # drafts from the earlier samples' outputs too
    SpeculationParams(proposer="hybrid", draft_tokens=2, adaptive=True),  # the source (and k) chosen per round
], ids=["plain", "ngram", "draft_model", "suffix", "hybrid"])
def test_speculative_sampling_matches_the_exact_distribution(engine, spec):
    dist = exact_distribution(engine)
    assert abs(sum(dist.values()) - 1.0) < 1e-9
    requests = [GenerateRequest(rid=str(i), input_ids=PROMPT, sampling=SamplingParams(
        **{**{f: getattr(PARAMS, f) for f in PARAMS.__slots__}, "sampling_seed": BASE_SEED + i}),
        speculation=spec) for i in range(N)]
    events = run_all(engine, requests)
    counts: dict[tuple[int, ...], int] = {}
    drafted = accepted = 0
    for r in requests:
        out = events[r.rid][-1]
        counts[out.output_ids] = counts.get(out.output_ids, 0) + 1
        drafted += out.stats.num_proposed_drafts
        accepted += out.stats.num_correct_drafts
    if spec.proposer != "none":  # the test is only meaningful if drafts were both accepted and rejected
        assert 0 < accepted < drafted, (accepted, drafted)
    pvalue = chi_square(counts, dist, N)
    assert pvalue > ALPHA, (f"{spec.proposer}: chi-square p = {pvalue:.2e} <= {ALPHA} with N={N}, "
                            f"seeds {BASE_SEED}..{BASE_SEED + N - 1}")
