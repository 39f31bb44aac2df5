"""Test-only fault injection (backends/engine/faults.py) on a tiny random model, through the real engine.

- ``lossy_accept`` commits each round's first draft unverified: greedy output leaves plain decoding's, yet
  every other committed token is the argmax of a teacher-forced forward of the committed sequence (the
  rest of the round is verified exactly), and the KV caches still hold exactly the committed prefix;
- ``random_draft`` replaces drafts with random ids: greedy output stays plain decoding's, acceptance
  collapses (no draft accepted where n-gram drafts are accepted in most rounds);
- plain requests (k = 0) are untouched in every mode; a bad mode is refused with the allowed values.
"""

from __future__ import annotations

import pytest
import torch

from backends.engine.faults import FaultInjector
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from tests.engine.engine_helpers import RoundLog, check_caches, final, make_tiny_engine

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=24, temperature=0.8, ignore_eos=True, sampling_seed=7)
BASE = tuple([101, 102, 103, 104, 105] * 6)
NGRAM = SpeculationParams(proposer="ngram", draft_tokens=4)
DRAFT = SpeculationParams(proposer="draft_model", draft_tokens=3)


@pytest.fixture(scope="module")
def engine(real_tokenizer):
    engine = make_tiny_engine(real_tokenizer, seed=1)
    yield engine
    engine.faults.set("off")


@pytest.fixture(scope="module")
def echo_prompt(engine) -> tuple[int, ...]:
    """``P + C + P`` with C the model's own greedy continuation of P: at its end the n-gram proposer drafts C,
    which this seeded model accepts in most rounds (asserted in the random_draft test)."""
    engine.faults.set("off")
    echo = final(engine, GenerateRequest(rid="echo", input_ids=BASE, sampling=GREEDY)).output_ids[:16]
    return BASE + echo + BASE


def run(engine, mode: str, prompt, speculation=SpeculationParams(), sampling=GREEDY, check=False):
    """One request in ``mode``; with ``check``, the cache invariants are asserted after every step."""
    engine.faults.set(mode)
    events = []
    engine.submit(GenerateRequest(rid=f"{mode}-{speculation.proposer}", input_ids=tuple(prompt), sampling=sampling,
                                  speculation=speculation), events.append)
    while engine.step():
        if check:
            check_caches(engine)
    engine.faults.set("off")
    return events[-1]


def teacher_forced_argmax(engine, prompt, output_ids) -> list[int]:
    """argmax of the target at every output position, given the committed sequence before it."""
    ids = torch.tensor([list(prompt) + list(output_ids)])
    with torch.inference_mode():
        logits = engine.runner.model(input_ids=ids).logits[0]
    return logits[len(prompt) - 1:len(prompt) - 1 + len(output_ids)].argmax(-1).tolist()


@pytest.mark.parametrize("speculation", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
def test_lossy_accept_commits_the_first_draft_unverified_and_the_cache_follows(engine, echo_prompt, monkeypatch,
                                                                               speculation):
    plain = run(engine, "off", echo_prompt)
    log = RoundLog(monkeypatch)
    lossy = run(engine, "lossy_accept", echo_prompt, speculation, check=True)
    assert len(lossy.output_ids) == 24 and lossy.output_ids != plain.output_ids
    rounds = log.of(lossy)
    assert sum(r.committed for r in rounds) == 24
    assert all(r.accepted >= 1 for r in rounds if r.k)  # the first draft always goes in
    # every token is the target's choice given what was committed before it, except forced first drafts
    argmax = teacher_forced_argmax(engine, echo_prompt, lossy.output_ids)
    start, forced_wrong = 0, 0
    for r in rounds:
        for i in range(start, start + r.committed):
            if i == start and r.k:
                forced_wrong += lossy.output_ids[i] != argmax[i]
            else:
                assert lossy.output_ids[i] == argmax[i], f"token {i} (round at {start}) was not verified"
        start += r.committed
    assert forced_wrong >= 1  # the output left plain decoding's because a wrong first draft was committed


def test_lossy_accept_sampled_accepts_the_first_draft_of_every_round(engine, echo_prompt, monkeypatch):
    log = RoundLog(monkeypatch)
    out = run(engine, "lossy_accept", echo_prompt, DRAFT, sampling=SAMPLED, check=True)
    rounds = log.of(out)
    assert len(out.output_ids) == 24 and any(r.k for r in rounds)
    assert all(1 <= r.accepted <= r.k for r in rounds if r.k)


def test_random_draft_keeps_greedy_output_and_collapses_acceptance(engine, echo_prompt):
    plain = run(engine, "off", echo_prompt)
    exact = run(engine, "off", echo_prompt, NGRAM)
    random = run(engine, "random_draft", echo_prompt, NGRAM, check=True)
    assert exact.output_ids == random.output_ids == plain.output_ids
    assert exact.stats.num_correct_drafts >= 8 and exact.stats.accept_length > 1.5  # n-gram drafting works here
    assert random.stats.num_proposed_drafts > 0
    assert random.stats.num_correct_drafts == 0 and random.stats.accept_length == 1.0
    drafted = run(engine, "random_draft", echo_prompt, DRAFT, check=True)  # the draft model's cache resyncs
    assert drafted.output_ids == plain.output_ids and drafted.stats.num_correct_drafts == 0


@pytest.mark.parametrize("mode", ["lossy_accept", "random_draft"])
def test_plain_requests_are_untouched(engine, echo_prompt, mode):
    assert run(engine, mode, echo_prompt).output_ids == run(engine, "off", echo_prompt).output_ids


def test_random_drafts_are_seeded_ids_of_the_vocabulary_and_bad_modes_are_refused():
    from backends.engine.proposers.base import Proposal

    proposal = Proposal(tokens=[5, 6, 7], draft_probs=torch.ones(3, 50) / 50, seconds=0.25, match=2)
    first, second = FaultInjector(vocab=50).random_drafts(proposal), FaultInjector(vocab=50).random_drafts(proposal)
    assert first == second and len(first.tokens) == 3 and all(0 <= t < 50 for t in first.tokens)
    assert (first.draft_probs, first.seconds, first.match) == (None, 0.25, 2)
    injector = FaultInjector(vocab=50)
    with pytest.raises(ValueError) as exc:
        injector.set("lossy")
    assert str(exc.value) == "fault mode must be one of off, lossy_accept, random_draft, got 'lossy'"
    assert injector.mode == "off"
