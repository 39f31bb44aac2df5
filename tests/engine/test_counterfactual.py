"""Replay of model-free proposers on recorded greedy requests reproduces the engine's rounds exactly."""

from __future__ import annotations

import pytest

from backends.engine.counterfactual import Recorded, mean_accept_length, replay
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from tests.engine.engine_helpers import RoundLog, run_all

TEXTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "one two three one two three one two",
         "The quick brown fox. The quick brown fox. The quick", "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,"]


@pytest.mark.parametrize("spec", [
    SpeculationParams(proposer="none"),
    SpeculationParams(proposer="ngram", draft_tokens=4),
    SpeculationParams(proposer="ngram", draft_tokens=3, ngram_max=2, ngram_match="latest"),
    SpeculationParams(proposer="suffix", draft_tokens=8),
], ids=["plain", "ngram-k4", "ngram-latest-k3", "suffix-k8"])
@pytest.mark.real_model
def test_replay_runs_the_rounds_the_engine_ran(real_model, real_tokenizer, monkeypatch, spec):
    """A stream of requests, one after another, over two scopes (the last repeats the first, so suffix
    drafts from its scope's earlier outputs): every round's draft count and accepted count. The real model
    (a random one copies nothing, so nothing would be accepted)."""
    engine = real_model
    log = RoundLog(monkeypatch)
    records, engine_rounds = [], []
    scopes = (f"replay-{spec.proposer}-{spec.draft_tokens}-a", f"replay-{spec.proposer}-{spec.draft_tokens}-b")
    for n, (text, scope) in enumerate([(t, s) for s in scopes for t in TEXTS] + [(TEXTS[0], scopes[0])]):
        prompt = tuple(real_tokenizer.encode(text))
        limit = 10 + 3 * (n % 4)
        sampling = SamplingParams(temperature=0.0, max_new_tokens=limit, ignore_eos=True)
        request = GenerateRequest(rid=str(n), input_ids=prompt, sampling=sampling,
                                  speculation=SpeculationParams(**{**_fields(spec), "scope": scope}))
        out = run_all(engine, [request])[str(n)][-1]
        engine_rounds.append([(r.k, r.accepted) for r in log.of(out)])
        records.append(Recorded(prompt=prompt, output=out.output_ids, max_new_tokens=limit, scope=scope))
    replayed = replay(records, spec)
    assert [list(zip(r.drafted, r.accepted)) for r in replayed] == engine_rounds
    if spec.proposer != "none":  # the comparison covered rounds that accepted drafts
        assert sum(sum(r.accepted) for r in replayed) > 0
    assert mean_accept_length(replayed) == pytest.approx(
        sum(len(r.output) for r in records) / sum(len(rounds) for rounds in engine_rounds))


def test_replay_refuses_what_is_not_a_function_of_the_trace():
    with pytest.raises(ValueError, match="draft_model"):
        replay([], SpeculationParams(proposer="draft_model"))
    with pytest.raises(ValueError, match="adaptive=True"):
        replay([], SpeculationParams(proposer="ngram", adaptive=True))


def _fields(spec: SpeculationParams) -> dict:
    return {name: getattr(spec, name) for name in spec.__slots__}
