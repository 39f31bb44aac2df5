"""Replay on recorded greedy requests reproduces the engine's rounds exactly: the model-free proposers from
the ids, the draft model from one teacher-forced pass's match flags."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.engine.counterfactual import Recorded, mean_accept_length, replay
from replay.trace_build import from_trace
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from tests.engine.engine_helpers import RoundLog, run_all

TEXTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "one two three one two three one two",
         "The quick brown fox. The quick brown fox. The quick", "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,"]


@pytest.mark.parametrize("spec", [
    SpeculationParams(proposer="none"),
    SpeculationParams(proposer="ngram", draft_tokens=4),
    SpeculationParams(proposer="ngram", draft_tokens=3, ngram_max=2, ngram_match="latest"),
    SpeculationParams(proposer="suffix", draft_tokens=8),
    SpeculationParams(proposer="hybrid", draft_tokens=8),
], ids=["plain", "ngram-k4", "ngram-latest-k3", "suffix-k8", "hybrid-k8"])
@pytest.mark.real_model
def test_replay_runs_the_rounds_the_engine_ran(real_model, real_tokenizer, monkeypatch, spec):
    """A stream of requests, one after another, over two scopes (the last repeats the first, so suffix
    drafts from its scope's earlier outputs): every round's draft count and accepted count. The real model
    (a random one copies nothing, so nothing would be accepted). Hybrid's rule learns across the stream
    (the engine's pooled acceptance), so the stream starts with none, as replay's does."""
    engine = real_model
    engine.slot_maker.shared_controllers.pop(("pooled", "hybrid"), None)
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
    with pytest.raises(ValueError, match="proposer draft_model needs matches"):
        replay([], SpeculationParams(proposer="draft_model"))
    with pytest.raises(ValueError, match="adaptive=True"):
        replay([], SpeculationParams(proposer="ngram", adaptive=True))


def _fields(spec: SpeculationParams) -> dict:
    return {name: getattr(spec, name) for name in spec.__slots__}


# ---- draft model: replay from teacher-forced match flags ----------------------------------------------

def _record(output_len: int, max_new_tokens: int | None = None) -> Recorded:
    return Recorded(prompt=(7, 8, 9), output=tuple(range(100, 100 + output_len)),
                    max_new_tokens=max_new_tokens or output_len)


def _rounds(matches: str, k: int, max_new_tokens: int | None = None) -> list[tuple[int, int]]:
    record = _record(len(matches), max_new_tokens)
    [result] = replay([record], SpeculationParams(proposer="draft_model", draft_tokens=k),
                      matches=[[m == "1" for m in matches]])
    return list(zip(result.drafted, result.accepted))


def test_a_draft_round_accepts_the_run_of_matches_from_its_start():
    # positions 0..7: 1 1 0 1 1 1 0 1; k = 3. Round 1 at 0 accepts 0,1, mismatches 2 (the target's token
    # is committed there); round 2 at 3 accepts 3,4,5 (k reached, bonus at 6); round 3 at 7 accepts
    # nothing it could (its budget is 0: one token left), a plain step.
    assert _rounds("11011101", k=3) == [(3, 2), (3, 3), (0, 0)]
    assert _rounds("11011101", k=1) == [(1, 1), (1, 0), (1, 1), (1, 1), (0, 0)]


def test_the_budget_caps_a_round_as_the_engine_does():
    # k is capped at max_new_tokens - done - 1 (the round's extra token must fit); with a larger limit
    # than the output (a stop ended it) the cap is the limit, and flags past the output are unknown.
    assert _rounds("1111", k=8) == [(3, 3)]
    assert _rounds("1111", k=8, max_new_tokens=20) == [(8, 4)]
    assert _rounds("0000", k=2) == [(2, 0), (2, 0), (1, 0), (0, 0)]


@given(st.text(alphabet="01", min_size=1, max_size=40), st.integers(1, 8), st.integers(0, 5))
def test_draft_rounds_invariants(matches, k, slack):
    """Every round drafts min(k, tokens left - 1) (the draft model always drafts its whole budget),
    accepts exactly the run of matches from its start (capped by what it drafted), and the rounds commit
    the output: accepted + 1 each, the last possibly cut by the end of the output (a stop)."""
    limit = len(matches) + slack
    done = 0
    rounds = _rounds(matches, k, limit)
    for n, (drafted, accepted) in enumerate(rounds):
        assert drafted == min(k, limit - done - 1)
        run = len(matches[done:]) - len(matches[done:].lstrip("1"))
        assert accepted == min(run, drafted)
        done += accepted + 1
        assert (done < len(matches)) == (n < len(rounds) - 1)
    assert done >= len(matches)


def test_draft_model_replay_needs_one_flag_per_output_token():
    spec = SpeculationParams(proposer="draft_model", draft_tokens=2)
    with pytest.raises(ValueError, match="needs matches"):
        replay([_record(3)], spec)
    with pytest.raises(ValueError, match="matches has 0 entries for 1 records"):
        replay([_record(3)], spec, matches=[])
    with pytest.raises(ValueError, match="record 0: 2 match flags for 3 output tokens"):
        replay([_record(3)], spec, matches=[[True, True]])


DRAFT_SAMPLINGS = {
    "greedy": {},
    # penalties and min_new_tokens change the draft's argmax per position (its history is the committed one)
    "penalised": {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "min_new_tokens": 6},
}


@pytest.mark.parametrize(("layers", "sampling_name"), [(8, "greedy"), (20, "greedy"), (20, "penalised")],
                         ids=["self8-greedy", "self20-greedy", "self20-penalised"])
@pytest.mark.real_model
def test_draft_model_replay_runs_the_rounds_the_engine_ran(real_model, real_tokenizer, monkeypatch, layers,
                                                           sampling_name):
    """One teacher-forced pass of the self-draft per request, then replay for k = 1 and 4: every round's
    draft count and accepted count equal the engine's (its draft model run incrementally, with its own
    cache, rollbacks and re-feeds). 8 layers is the worker's default pair (it rarely matches); 20 layers
    matches often, so long accepted runs are compared too. Not ignoring EOS: a stop may end a request."""
    from backends.engine.config import EngineConfig
    from backends.engine.counterfactual import draft_matches
    from backends.engine.engine import Engine

    engine = Engine(EngineConfig(model_path="<real>", calibrate=False, draft_layers=layers),
                    model=real_model.runner.model, tokenizer=real_tokenizer)
    log = RoundLog(monkeypatch)
    near = 0
    for k in (1, 4):
        records, flags, engine_rounds = [], [], []
        for n, text in enumerate(TEXTS):
            prompt = tuple(real_tokenizer.encode(text))
            limit = 10 + 3 * (n % 4)
            sampling = SamplingParams(temperature=0.0, max_new_tokens=limit, **DRAFT_SAMPLINGS[sampling_name])
            request = GenerateRequest(rid=f"{k}-{n}", input_ids=prompt, sampling=sampling,
                                      speculation=SpeculationParams(proposer="draft_model", draft_tokens=k))
            out = run_all(engine, [request])[request.rid][-1]
            engine_rounds.append([(r.k, r.accepted) for r in log.of(out)])
            stops = engine.eos_ids if not sampling.ignore_eos else frozenset()
            matched = draft_matches(engine.draft_runner, prompt, out.output_ids, sampling, stops)
            near += matched.near_ties(1e-3)
            records.append(Recorded(prompt=prompt, output=out.output_ids, max_new_tokens=limit))
            flags.append(matched.matches)
        replayed = replay(records, SpeculationParams(proposer="draft_model", draft_tokens=k), matches=flags)
        assert [list(zip(r.drafted, r.accepted)) for r in replayed] == engine_rounds, f"k={k}, {near} near ties"
        if layers == 20:  # the comparison covered rounds that accepted drafts
            assert sum(sum(r.accepted) for r in replayed) > 0


def test_from_trace_takes_greedy_records_and_the_pair_asked_for():
    from policies.features import RequestFeatures
    from policies.trace import Sampling, Served, TraceRequest

    def traced(rid: str, temperature: float = 0.0, flags: dict | None = None) -> TraceRequest:
        return TraceRequest(id=rid, arrival_s=0.0, route="app", features=RequestFeatures(),
                            sampling=Sampling(temperature=temperature, max_new_tokens=5),
                            served=Served(proposer="none", draft_tokens=0, finish="length"),
                            draft_matches={"0123456789ab": "101"} if flags is None else flags,
                            prompt_ids=[1, 2], output_ids=[3, 4, 5])

    records, matches = from_trace([traced("a")], pair="0123456789ab")
    assert records == [Recorded(prompt=(1, 2), output=(3, 4, 5), max_new_tokens=5, scope="app")]
    assert matches == [(True, False, True)]
    assert from_trace([traced("a")]) == (records, None)
    with pytest.raises(ValueError, match="request 'b': temperature 0.7 has no exact counterfactual"):
        from_trace([traced("a"), traced("b", 0.7)])
    with pytest.raises(ValueError, match="request 'a': no draft_matches for pair ba9876543210"):
        from_trace([traced("a")], pair="ba9876543210")
