"""Continuous batching in the engine (tiny model): one target forward per step, for every running sequence.

- Requests submitted together (plain, n-gram, draft model, suffix, a seeded sampled one) share every step's
  ONE ``forward_batch``, which carries every running sequence; each output is the one that request gets alone.
- Chunked prefill is mixed into decode steps: a long prompt arriving while others decode is fed at most
  ``prefill_chunk`` tokens a step, in the same forward as the others' rounds, within what the rounds leave of
  ``max_batch_tokens``; it waits while the rounds fill the budget. Prompts prefilling together are fed
  shortest remaining first.
- A failed forward fails exactly that step's sequences (an "internal error" abort, status 500); the engine
  then serves the next request as if nothing happened.
"""

from __future__ import annotations

import dataclasses

import pytest

from backends.engine.sequence import Status
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from tests.engine.batching_helpers import GREEDY, StepLog, feed_three_prompts, prompt
from tests.engine.engine_helpers import final, make_tiny_engine, run_all

# rid: (speculation, base prompt length, its first id); the bases are ones on which the proposer gets drafts
# accepted on this seeded model (the outputs are deterministic; the test asserts acceptance, not a rate)
SPECULATIONS = {
    "plain": (SpeculationParams(), 14, 300),
    "ngram-k4": (SpeculationParams(proposer="ngram", draft_tokens=4), 10, 1100),
    "draft-k3": (SpeculationParams(proposer="draft_model", draft_tokens=3), 8, 700),
    "suffix-k6": (SpeculationParams(proposer="suffix", draft_tokens=6), 7, 300),
    "sampled-draft-k3": (SpeculationParams(proposer="draft_model", draft_tokens=3), 12, 700),
    "ngram-adaptive": (SpeculationParams(proposer="ngram", draft_tokens=6, adaptive=True), 5, 1100),
}
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=24, sampling_seed=1234)


@pytest.fixture(scope="module")
def mixed(real_tokenizer) -> list[GenerateRequest]:
    """Six requests, prompts of 26..44 tokens. A random model drafts poorly from arbitrary text, so each prompt
    is ``P + C + P`` with C the model's own greedy continuation of P: at its end the n-gram and suffix
    proposers find P and draft C, which the target then partly accepts (asserted, so the test can tell)."""
    engine = make_tiny_engine(real_tokenizer)
    requests = []
    for rid, (spec, n, start) in SPECULATIONS.items():
        base = prompt(n, start)
        echo = final(engine, GenerateRequest(rid="echo", input_ids=base, sampling=GREEDY)).output_ids[:16]
        requests.append(GenerateRequest(rid=rid, input_ids=base + echo + base, speculation=spec,
                                        sampling=SAMPLED if rid.startswith("sampled") else GREEDY))
    return requests


def alone(tokenizer, request: GenerateRequest, **config):
    """The request on a fresh engine of the same model, with nothing else running."""
    return final(make_tiny_engine(tokenizer, **config), request)


def test_one_forward_per_step_carries_every_running_sequence_and_outputs_are_as_alone(real_tokenizer, mixed):
    engine = make_tiny_engine(real_tokenizer)
    log = StepLog(engine)
    events = log.submit(mixed)
    while log.step():
        pass
    assert len(log.steps) >= 24  # at least one step per token of the longest plain request
    for i, step in enumerate(log.steps):
        where = f"step {i}: running {step['running']}, works {step['works']}"
        assert step["forwards"] == 1, f"{where}: {step['forwards']} target forwards"
        assert step["batch"] == len(step["running"]) == len(step["works"]), where
        assert step["fed"] == step["caches"], where
    assert max(step["batch"] for step in log.steps) == len(mixed)
    together = {rid: evs[-1] for rid, evs in events.items()}
    accepted = {rid: out.stats.num_correct_drafts for rid, out in together.items()}
    assert all(accepted[r.rid] > 0 for r in mixed if r.speculation.proposer != "none"), accepted
    for request in mixed:
        got, want = together[request.rid], alone(real_tokenizer, request)
        assert (got.output_ids, got.finish_reason) == (want.output_ids, want.finish_reason), request.rid
        assert len(got.output_ids) == 24, request.rid
    # the sampled request really samples: another seed gives another output
    sampled = mixed[4]
    reseeded = dataclasses.replace(sampled, sampling=dataclasses.replace(sampled.sampling, sampling_seed=99))
    assert alone(real_tokenizer, reseeded).output_ids != together[sampled.rid].output_ids


def check_budget(log: StepLog, budget: int, chunk: int, long_rid: str, long_prompt: int) -> dict[str, int]:
    """Every step within its token budget; the long prompt's chunks exactly what the budget leaves.

    Returns counts of steps where a chunk rode along with >= 2 rounds (mixed) and where rounds filled the
    budget while the long prompt waited (waited)."""
    counts = {"mixed": 0, "waited": 0}
    prefilled = 0
    for i, step in enumerate(log.steps):
        rounds = sum(n for _, status, n in step["works"] if status is Status.DECODE)
        fed = sum(n for _, _, n in step["works"])
        where = f"step {i}: works {step['works']} (budget {budget}, chunk {chunk})"
        assert step["forwards"] == (1 if step["works"] else 0), where
        assert fed <= max(budget, rounds), where
        chunks = [n for rid, status, n in step["works"] if status is Status.PREFILL]
        assert all(n <= chunk for n in chunks), where
        waiting = long_rid in step["running"] and prefilled < long_prompt - 1
        if not waiting:
            continue
        others = sum(n for rid, status, n in step["works"] if status is Status.PREFILL and rid != long_rid)
        want = min(chunk, max(0, budget - rounds - others), long_prompt - 1 - prefilled)
        got = sum(n for rid, _, n in step["works"] if rid == long_rid)
        assert got == want, f"{where}: the long prompt fed {got}, want {want}"
        prefilled += got
        decoding = sum(1 for _, status, _ in step["works"] if status is Status.DECODE)
        counts["mixed"] += got > 0 and decoding >= 2
        counts["waited"] += got == 0 and rounds >= budget
    assert prefilled == long_prompt - 1
    return counts


@pytest.mark.parametrize("k, expect_wait", [(3, False), (7, True)])
def test_a_long_prompt_is_prefilled_in_chunks_mixed_into_decode_steps(real_tokenizer, k, expect_wait):
    """Three decoders with draft_model k feed 3 * (k + 1) tokens a round: 12 of 24 (k = 3: the chunk gets the
    other 12, less than prefill_chunk 16) or 24 of 24 (k = 7: the long prompt waits until rounds shrink)."""
    budget, chunk = 24, 16
    config = dict(max_batch_tokens=budget, prefill_chunk=chunk)
    engine = make_tiny_engine(real_tokenizer, **config)
    log = StepLog(engine)
    spec = SpeculationParams(proposer="draft_model", draft_tokens=k)
    decoders = [GenerateRequest(rid=f"d{i}", input_ids=prompt(6 + i, 200 + 50 * i), speculation=spec,
                                sampling=dataclasses.replace(GREEDY, max_new_tokens=20 + 4 * i)) for i in range(3)]
    events = log.submit(decoders)
    for _ in range(2):  # step 1 prefills the three prompts, step 2 is their first round
        log.step()
    assert [s.status for s in engine.scheduler.running] == [Status.DECODE] * 3
    long = GenerateRequest(rid="long", input_ids=prompt(150, 400), sampling=GREEDY)
    events |= log.submit([long])
    while log.step():
        pass
    counts = check_budget(log, budget, chunk, "long", len(long.input_ids))
    print(f"k = {k}: {counts}, chunks of the long prompt:",
          [n for step in log.steps for rid, _, n in step["works"] if rid == "long"])
    if expect_wait:
        assert counts["waited"] >= 1, counts
    else:
        assert counts["waited"] == 0 and counts["mixed"] >= 5, counts
    # the chunked, mixed prefill changes nothing: every output is the one it gets alone, unbatched
    for request in [*decoders, long]:
        assert events[request.rid][-1].output_ids == alone(real_tokenizer, request, **config).output_ids, \
            request.rid


def test_prompts_prefilling_together_are_fed_shortest_remaining_first(real_tokenizer):
    """a (59 tokens to prefill), b (49) and c (9), admitted in that order, chunks of 16 within 32 tokens a step:
    c is fed whole in step 1 and b before a (in admission order step 1 would have fed a 16 and b 16, and c
    nothing); a prompt fed whole decodes from the next step; every output is the one it gets alone."""
    config = dict(prefill_chunk=16, max_batch_tokens=32)
    requests, events, chunks, rounds = feed_three_prompts(make_tiny_engine(real_tokenizer, **config))
    assert chunks[:6] == [[("c", 9), ("b", 16), ("a", 7)], [("b", 16), ("a", 15)], [("b", 16), ("a", 15)],
                          [("b", 1), ("a", 16)], [("a", 6)], []]
    assert rounds[:6] == [[], ["c"], ["c"], ["c"], ["b", "c"], ["a", "b", "c"]]
    for request in requests:
        assert events[request.rid][-1].output_ids == alone(real_tokenizer, request, **config).output_ids, \
            request.rid


def test_a_failed_forward_fails_that_steps_sequences_and_the_engine_keeps_serving(real_tokenizer, mixed,
                                                                                 monkeypatch):
    engine = make_tiny_engine(real_tokenizer)
    calls = {"n": 0}
    forward_batch = engine.runner.forward_batch

    def failing_once(feeds):
        calls["n"] += 1
        if calls["n"] == 3:
            calls["failed"] = sorted(len(feed.tokens) for feed in feeds)
            raise RuntimeError("simulated device fault")
        return forward_batch(feeds)

    monkeypatch.setattr(engine.runner, "forward_batch", failing_once)
    requests = mixed[:3]
    events = {r.rid: [] for r in requests}
    for request in requests:
        engine.submit(request, events[request.rid].append)
    engine.step()
    engine.step()
    late = GenerateRequest(rid="late", input_ids=prompt(40, 1500), sampling=GREEDY)  # prefills in the failing step
    events["late"] = []
    engine.submit(late, events["late"].append)
    engine.step()  # the third forward raises
    assert calls["n"] == 3
    # the failing forward carried the three rounds and the late prompt's whole prefill (39 tokens)
    assert len(calls["failed"]) == 4 and calls["failed"][-1] == len(late.input_ids) - 1, calls
    for rid, evs in events.items():
        out = evs[-1]
        assert out.finished, rid
        assert out.finish_reason.to_dict() == {"type": "abort", "message": "internal error: simulated device fault",
                                               "status_code": 500}, rid
    assert engine.scheduler.running == [] and engine.scheduler.reserved == 0 and engine._slots == {}
    # the engine keeps serving, and its next requests are exactly what a fresh engine gives
    after = [dataclasses.replace(r, rid=f"{r.rid}-again") for r in (*requests, late)]
    outputs = run_all(engine, after)
    assert calls["n"] > 3
    for request in after:
        got, want = outputs[request.rid][-1], alone(real_tokenizer, request)
        assert got.finish_reason.type == "length"
        assert got.output_ids == want.output_ids, request.rid


def test_per_round_ngram_sequences_of_a_step_are_planned_together_and_outputs_are_as_alone(real_tokenizer, mixed,
                                                                                             monkeypatch):
    """specgate's controller over n-gram drafts: the sequences of a step get their k from ONE plan_step over all
    their drawn gains (adaptive.plan_step), each feeds exactly its allocation, and greedy output is unchanged."""
    import backends.engine.engine as engine_module

    base = next(r for r in mixed if r.rid == "ngram-adaptive")
    requests = [dataclasses.replace(base, rid=f"adaptive-{i}") for i in range(3)]
    requests.append(next(r for r in mixed if r.rid == "ngram-k4"))  # a fixed k: priced in, not planned
    plans = []
    real_plan = engine_module.plan_step

    def spy(gains, committed, step_s):
        drafts = real_plan(gains, committed, step_s)
        plans.append((len(gains), committed, drafts))
        return drafts

    monkeypatch.setattr(engine_module, "plan_step", spy)
    engine = make_tiny_engine(real_tokenizer)
    log = StepLog(engine)
    events = log.submit(requests)
    while log.step():
        pass
    joint_steps = [(i, step) for i, step in enumerate(log.steps)
                   if sum(rid.startswith("adaptive") and status is Status.DECODE
                          for rid, status, _ in step["works"]) >= 2]
    assert len(plans) == len(joint_steps) >= 10
    planned_drafts = 0
    for (i, step), (n, committed, drafts) in zip(joint_steps, plans):
        rounds = [(rid, fed) for rid, status, fed in step["works"] if status is Status.DECODE]
        joint = [fed - 1 for rid, fed in rounds if rid.startswith("adaptive")]
        assert (n, committed) == (len(joint), float(len(rounds))), f"step {i}: {rounds}"
        assert joint == drafts, f"step {i}: planned {drafts}, fed {rounds}"  # gains stop at the drafts found
        planned_drafts += sum(joint)
    assert planned_drafts > 0  # the plan drafted, so the identity below covers planned rounds
    for request in requests:
        got, want = events[request.rid][-1], alone(real_tokenizer, request)
        assert got.output_ids == want.output_ids, request.rid
