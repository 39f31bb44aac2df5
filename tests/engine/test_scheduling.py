"""Admission, KV capacity, the waiting queue, round-robin fairness and abort (tiny model)."""

from __future__ import annotations

import pytest

from backends.engine.scheduler import AdmissionError
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from tests.engine.engine_helpers import make_tiny_engine, run_all



def request(rid: str, n_prompt: int = 5, **sampling) -> GenerateRequest:
    params = SamplingParams(**{"temperature": 0.0, "max_new_tokens": 12, **sampling})
    return GenerateRequest(rid=rid, input_ids=tuple(range(100, 100 + n_prompt)), sampling=params,
                           speculation=SpeculationParams(proposer="ngram", draft_tokens=3))


def test_request_larger_than_kv_capacity_is_refused_at_submit(real_tokenizer):
    engine = make_tiny_engine(real_tokenizer, max_total_tokens=32)
    # reserved = prompt 10 + max_new_tokens 20 + k 3 + 1 = 34 > 32
    with pytest.raises(AdmissionError) as err:
        engine.submit(request("big", 10, max_new_tokens=20), lambda out: None)
    assert str(err.value) == ("request needs up to 34 KV tokens (prompt + max_new_tokens + draft) but the "
                              "worker's capacity is 32; lower max_new_tokens or shorten the prompt")
    engine.submit(request("fits", 10, max_new_tokens=18), lambda out: None)  # exactly 32


def test_bad_prompts_are_refused_with_a_clear_message(real_tokenizer):
    engine = make_tiny_engine(real_tokenizer)
    with pytest.raises(ValueError, match="input_ids is empty"):
        engine.submit(GenerateRequest(rid="e", input_ids=()), lambda out: None)
    with pytest.raises(ValueError, match=r"input_ids must be token ids in \[0, 49152\)"):
        engine.submit(GenerateRequest(rid="v", input_ids=(49152,)), lambda out: None)
    with pytest.raises(AdmissionError, match="context window is 512; shorten the prompt"):
        engine.submit(GenerateRequest(rid="c", input_ids=(1,) * 512), lambda out: None)


def test_waiting_queue_admits_in_fifo_order_when_capacity_frees(real_tokenizer):
    engine = make_tiny_engine(real_tokenizer, max_running_requests=2)
    finished: list[str] = []
    for rid in "abcd":
        engine.submit(request(rid), lambda out, rid=rid: finished.append(rid) if out.finished else None)
    engine.step()
    load = engine.load()
    assert (load.num_running_reqs, load.num_waiting_reqs) == (2, 2)
    assert [s.rid for s in engine.scheduler.running] == ["a", "b"]
    while engine.step():
        assert engine.load().num_running_reqs <= 2
    assert finished == ["a", "b", "c", "d"]


def test_kv_reservation_holds_requests_back_until_tokens_free(real_tokenizer):
    engine = make_tiny_engine(real_tokenizer, max_total_tokens=40)
    for rid in "ab":  # each reserves 5 + 12 + 3 + 1 = 21: only one fits in 40 at a time
        engine.submit(request(rid), lambda out: None)
    engine.step()
    assert [s.rid for s in engine.scheduler.running] == ["a"]
    assert engine.scheduler.reserved == 21
    while engine.step():
        assert engine.scheduler.reserved <= 40
    assert engine.scheduler.reserved == 0


def test_round_robin_both_requests_progress_every_turn(real_tokenizer):
    engine = make_tiny_engine(real_tokenizer)
    lengths: dict[str, list[int]] = {"a": [], "b": []}
    for rid in lengths:
        engine.submit(request(rid, max_new_tokens=30), lambda out, rid=rid: lengths[rid].append(len(out.output_ids)))
    turns = 0
    while engine.step():
        turns += 1
        if all(lengths.values()) and turns < 10:
            assert len(lengths["a"]) == len(lengths["b"])  # one round each per turn
    assert lengths["a"][-1] == lengths["b"][-1] == 30
    assert min(len(lengths["a"]), len(lengths["b"])) >= 2


def test_abort_frees_all_state(real_tokenizer):
    engine = make_tiny_engine(real_tokenizer)
    events: list = []
    engine.submit(request("a", max_new_tokens=50), events.append)
    engine.submit(request("w", max_new_tokens=50), lambda out: None)
    engine.step()
    engine.step()
    assert engine.load().num_running_reqs == 2 and engine.load().num_used_tokens > 0
    engine.abort("a")
    engine.abort("w")
    engine.step()
    load = engine.load()
    assert (load.num_running_reqs, load.num_waiting_reqs, load.num_used_tokens) == (0, 0, 0)
    assert engine.scheduler.reserved == 0 and not engine._slots
    final = events[-1]
    assert final.finished and final.finish_reason.to_dict() == {
        "type": "abort", "message": "aborted by request", "status_code": 499}


def test_abort_of_a_waiting_request(real_tokenizer):
    engine = make_tiny_engine(real_tokenizer, max_running_requests=1)
    events: list = []
    engine.submit(request("a"), lambda out: None)
    engine.submit(request("b"), events.append)
    engine.step()
    assert engine.load().num_waiting_reqs == 1
    engine.abort("b")
    engine.step()
    assert engine.load().num_waiting_reqs == 0 and events[-1].finish_reason.type == "abort"
    while engine.step():
        pass
    assert engine.load().num_used_tokens == 0


def test_concurrent_requests_match_their_solo_runs(real_tokenizer):
    """Interleaving sequences must not leak state between their caches or proposers."""
    engine = make_tiny_engine(real_tokenizer)
    reqs = [request(str(i), 3 + i, max_new_tokens=10 + i) for i in range(4)]
    together = run_all(engine, reqs)
    for r in reqs:
        alone = run_all(engine, [r])[r.rid][-1]
        assert together[r.rid][-1].output_ids == alone.output_ids


def test_sampling_seed_makes_output_reproducible(real_tokenizer):
    engine = make_tiny_engine(real_tokenizer, logit_scale=2.0)

    def sample(seed: int, proposer: str) -> tuple[int, ...]:
        req = GenerateRequest(rid="s", input_ids=(100, 101, 102),
                              sampling=SamplingParams(temperature=1.0, max_new_tokens=12, sampling_seed=seed),
                              speculation=SpeculationParams(proposer=proposer, draft_tokens=3))
        return run_all(engine, [req])["s"][-1].output_ids

    for proposer in ("none", "ngram", "draft_model"):
        assert sample(7, proposer) == sample(7, proposer)
        assert len({sample(seed, proposer) for seed in (7, 8, 9)}) == 3
