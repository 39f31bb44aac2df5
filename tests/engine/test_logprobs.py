"""Logprobs of committed tokens (SGLang's return_logprob / top_logprobs_num) on a tiny random model.

The reference is one teacher-forced forward of the whole committed sequence: the logprob reported for
output token i must be log_softmax(process_logits(logits at i)) of that sequence, whichever proposer
drafted it and however rounds cut the output, so speculation cannot change a reported number.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from tests.engine.engine_helpers import final, make_tiny_engine

PROMPT = tuple([101, 102, 103, 104, 105] * 6)  # repeats, so n-gram drafts get proposed and accepted
SPECS = {"plain": SpeculationParams(), "ngram-k4": SpeculationParams(proposer="ngram", draft_tokens=4),
         "draft_model-k3": SpeculationParams(proposer="draft_model", draft_tokens=3)}


@pytest.fixture(scope="module")
def engine(real_tokenizer):
    return make_tiny_engine(real_tokenizer, seed=3)


def reference(engine, output_ids: tuple[int, ...], temperature: float) -> torch.Tensor:
    """[len(output), vocab] log-probabilities from one forward over prompt + output (teacher forcing)."""
    ids = torch.tensor([list(PROMPT) + list(output_ids)])
    with torch.inference_mode():
        logits = engine.runner.model(input_ids=ids).logits[0].float()
    rows = logits[len(PROMPT) - 1:len(PROMPT) - 1 + len(output_ids)]
    return torch.log_softmax(rows if temperature < 1e-6 else rows / temperature, dim=-1)


def request(rid: str, spec: SpeculationParams, logprobs: int | None = 3, **sampling) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, **{"temperature": 0.0, **sampling})
    return GenerateRequest(rid=rid, input_ids=PROMPT, sampling=params, speculation=spec, logprobs=logprobs)


def check_against_reference(engine, out, temperature: float, top: int) -> None:
    ref = reference(engine, out.output_ids, temperature)
    assert [lp.token_id for lp in out.logprobs] == list(out.output_ids)
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    want = ref[torch.arange(len(out.output_ids)), torch.tensor(out.output_ids)]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    values, ids = torch.topk(ref, top, dim=-1)
    for i, lp in enumerate(out.logprobs):
        assert [t for t, _ in lp.top] == ids[i].tolist()
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), values[i], atol=1e-4)


@pytest.mark.parametrize("name", SPECS)
def test_greedy_logprobs_match_a_teacher_forced_forward_for_every_proposer(engine, name):
    out = final(engine, request(f"greedy-{name}", SPECS[name]))
    assert len(out.output_ids) == 24 and len(out.logprobs) == 24
    check_against_reference(engine, out, 0.0, top=3)
    # greedy picks the argmax, so every committed token is its position's most likely one
    assert all(lp.top[0] == (lp.token_id, lp.logprob) for lp in out.logprobs)
    if name != "plain":
        assert out.stats.num_correct_drafts > 0  # accepted drafts were among the reported tokens


def test_sampled_logprobs_are_of_the_temperature_scaled_distribution(engine):
    spec = SPECS["ngram-k4"]
    out = final(engine, request("sampled", spec, temperature=0.7, top_p=0.9, sampling_seed=11))
    check_against_reference(engine, out, 0.7, top=3)  # before top-p truncation, after temperature
    assert out.stats.num_proposed_drafts > 0


def test_speculation_reports_the_same_logprobs_as_plain_decoding_with_penalties(engine):
    penalties = {"frequency_penalty": 0.8, "repetition_penalty": 1.3}
    plain = final(engine, request("pen-plain", SPECS["plain"], logprobs=2, **penalties))
    spec = final(engine, request("pen-ngram", SPECS["ngram-k4"], logprobs=2, **penalties))
    assert spec.output_ids == plain.output_ids
    assert [(lp.token_id, [t for t, _ in lp.top]) for lp in spec.logprobs] == \
        [(lp.token_id, [t for t, _ in lp.top]) for lp in plain.logprobs]
    diffs = [abs(a.logprob - b.logprob) for a, b in zip(spec.logprobs, plain.logprobs)]
    assert max(diffs) < 1e-4
    # the penalties change the numbers: the reported distribution is the penalised one
    unpenalised = reference(engine, plain.output_ids, 0.0)
    raw = [unpenalised[i, t].item() for i, t in enumerate(plain.output_ids)]
    assert max(abs(a - lp.logprob) for a, lp in zip(raw, plain.logprobs)) > 0.01


def test_logprobs_stream_with_the_tokens_and_are_absent_unless_asked(engine):
    events = []
    engine.submit(request("streamed", SPECS["ngram-k4"], logprobs=0), events.append)
    while engine.step():
        pass
    assert all(len(e.logprobs) == len(e.output_ids) for e in events)
    assert all(lp.top == () for lp in events[-1].logprobs)  # logprobs=0: the chosen token only
    assert final(engine, request("none", SPECS["ngram-k4"], logprobs=None)).logprobs == ()


@pytest.mark.parametrize("bad", [-1, 21])
def test_a_logprobs_count_out_of_range_is_refused_at_submit(engine, bad):
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\]"):
        engine.submit(dataclasses.replace(request("bad", SPECS["plain"]), logprobs=bad), lambda out: None)


def test_a_stop_that_cuts_a_round_cuts_its_logprobs(engine):
    free = final(engine, request("free", SPECS["ngram-k4"]))
    stop_at = free.output_ids[9]
    cut = final(engine, dataclasses.replace(request("cut", SPECS["ngram-k4"]), sampling=SamplingParams(
        max_new_tokens=24, ignore_eos=True, temperature=0.0, stop_token_ids=(stop_at,))))
    n = free.output_ids.index(stop_at) + 1
    assert cut.output_ids == free.output_ids[:n] and cut.finish_reason.type == "stop"
    assert cut.logprobs == free.logprobs[:n]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prompt_logprobs_match_a_teacher_forced_forward_across_prefill_chunks(real_tokenizer, temperature):
    chunked = make_tiny_engine(real_tokenizer, seed=3, prefill_chunk=7)  # 29 prompt positions: 5 chunks
    ask = dataclasses.replace(request("prompt", SPECS["ngram-k4"], logprobs=2, temperature=temperature,
                                      sampling_seed=5), prompt_logprobs=True)
    out = final(chunked, ask)
    with torch.inference_mode():
        logits = chunked.runner.model(input_ids=torch.tensor([list(PROMPT)])).logits[0].float()
    ref = torch.log_softmax(logits if temperature == 0 else logits / temperature, dim=-1)
    assert [lp.token_id for lp in out.prompt_logprobs] == list(PROMPT)
    assert out.prompt_logprobs[0].logprob is None and out.prompt_logprobs[0].top == ()
    for i, lp in enumerate(out.prompt_logprobs[1:], 1):  # row i - 1 predicts prompt token i
        assert lp.logprob == pytest.approx(ref[i - 1, PROMPT[i]].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == torch.topk(ref[i - 1], 2).indices.tolist()
    check_against_reference(chunked, out, temperature, top=2)  # the output's are unchanged by it
    assert final(chunked, request("no-prompt", SPECS["ngram-k4"])).prompt_logprobs == ()
    with pytest.raises(ValueError, match="prompt_logprobs needs logprobs"):
        chunked.submit(dataclasses.replace(ask, logprobs=None), lambda out: None)
