"""Resuming a stream whose worker failed mid-answer (gateway/resume.py): the continuation's request, the chunks
the client gets from it, a stop string spanning the seam, and, at the fixture level, the whole path through
the real app in front of two SGLang stand-ins (tests/backends/replay_server.py serving SGLang's recorded
completions streams with ``return_token_ids``): the one that answers first drops the connection after two
chunks, the other gets ``POST /v1/completions`` with the prompt's ids + the ids sent. The same with real
workers and kill -9: tests/integration/test_gateway_resume.py."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from backends.sglang.client import OpenAIResult
from backends.sglang.openai_wire import ChatCompletionChunk, CompletionResponse
from gateway.resume import Converter, Progress, continuation_body, not_resumable
from tests.gateway.resume_stand_ins import gateway_in_front


def chunk(kind: type, body: dict[str, Any]) -> OpenAIResult[Any]:
    raw = json.dumps(body).encode()
    return OpenAIResult(raw, msgspec.json.decode(raw, type=kind))


def test_the_continuation_body_carries_the_ids_sent_and_what_is_left():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "min_tokens": 3,
            "temperature": 0.7, "top_p": 0.9, "seed": 5, "stop": ["\n\n"], "logprobs": True, "top_logprobs": 2,
            "stream": True, "stream_options": {"include_usage": False}, "user": "u"}
    custom = {"speculation": {"proposer": "none", "scope": "a"}}
    out = continuation_body(body, True, [1, 2, 3], [7, 8], "rid-r1", custom, 2048)
    assert out == {"model": "m", "temperature": 0.7, "top_p": 0.9, "seed": 5, "stop": ["\n\n"],
                   "prompt": [1, 2, 3, 7, 8], "max_tokens": 8, "min_tokens": 1, "logprobs": 2,
                   "custom_params": custom, "stream": True,
                   "stream_options": {"include_usage": True}, "return_token_ids": True, "rid": "rid-r1"}
    # no budget: up to the window, as the original (a completions request without max_tokens would get 16)
    assert continuation_body({"model": "m", "prompt": "x"}, False, [1, 2], [3], "r", None, 100)["max_tokens"] == 97


def test_what_never_resumes_and_why():
    assert not_resumable({"tools": [{"type": "function"}]}) == "structured"
    assert not_resumable({"response_format": {"type": "json_object"}}) == "structured"
    assert not_resumable({"response_format": {"type": "text"}}) is None
    assert not_resumable({"frequency_penalty": 0.5}) == "penalties"
    assert not_resumable({"repetition_penalty": 1.1}) == "penalties"
    assert not_resumable({"repetition_penalty": 1.0, "temperature": 0}) is None


def test_chat_chunks_keep_the_streams_id_and_usage_counts_every_token_once():
    progress = Progress(True, [])
    progress.take(chunk(ChatCompletionChunk, {"id": "chatcmpl-1", "created": 7, "model": "m", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "prompt_token_ids": [1, 2, 3]}]}).parsed)
    progress.take(chunk(ChatCompletionChunk, {"id": "chatcmpl-1", "created": 7, "model": "m", "choices": [
        {"index": 0, "delta": {"content": "Hello"}, "token_ids": [10, 11]}]}).parsed)
    assert (progress.prompt_ids, progress.output_ids, progress.chars) == ([1, 2, 3], [10, 11], 5)
    convert = Converter(progress, [], prompt_tokens=3)
    [out] = convert.convert(chunk(CompletionResponse, {"id": "cmpl-9", "created": 99, "model": "x", "choices": [
        {"index": 0, "text": " world", "finish_reason": "length", "token_ids": [12],
         "logprobs": {"tokens": [" world"], "token_logprobs": [-0.5], "top_logprobs": [{" world": -0.5}],
                      "text_offset": [0]}}]}))
    assert json.loads(out.raw) == {
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [
            {"index": 0, "delta": {"content": " world"}, "finish_reason": "length", "matched_stop": None,
             "token_ids": [12], "logprobs": {"content": [
                 {"token": " world", "logprob": -0.5, "bytes": list(b" world"),
                  "top_logprobs": [{"token": " world", "logprob": -0.5, "bytes": list(b" world")}]}]}}]}
    [usage] = convert.convert(chunk(CompletionResponse, {"id": "cmpl-9", "choices": [], "usage": {
        "prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}))
    assert json.loads(usage.raw)["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_a_stop_string_spanning_the_seam_still_stops():
    progress = Progress(False, ["STOP"])
    progress.take(chunk(CompletionResponse, {"id": "cmpl-1", "choices": [
        {"index": 0, "text": "go ST", "token_ids": [1, 2, 3], "prompt_token_ids": [9]}]}).parsed)
    assert progress.tail == "o ST"  # the longest stop's length
    convert = Converter(progress, ["STOP"], prompt_tokens=1)
    finish, usage = convert.convert(chunk(CompletionResponse, {"id": "x", "choices": [
        {"index": 0, "text": "OP and on", "token_ids": [4, 5]}]}))
    assert convert.stopped
    choice = json.loads(finish.raw)["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["matched_stop"]) == ("", "stop", "STOP")
    assert json.loads(usage.raw)["usage"] == {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}
    # a stop wholly inside the continuation is the continuing worker's own business
    other = Converter(progress, ["STOP"], prompt_tokens=1)
    [out] = other.convert(chunk(CompletionResponse, {"id": "x", "choices": [{"index": 0, "text": "ing"}]}))
    assert not other.stopped and json.loads(out.raw)["choices"][0]["text"] == "ing"


# -- fixture level: the real app in front of two SGLang stand-ins ---------------------------------------------

@pytest.fixture
def stand_ins(tmp_path, monkeypatch, request):
    monkeypatch.setenv("SPECGATE_ADMIN_TOKEN", "adm")
    with gateway_in_front(tmp_path, getattr(request, "param", "{max_resumes: 1}")) as front:
        yield front


def events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_an_sglang_completions_stream_resumes_with_the_prompt_ids_and_the_ids_sent(stand_ins):
    client, a, b = stand_ins
    body = {"model": "llama-3.1-8b", "prompt": "Count:", "max_tokens": 7, "temperature": 0, "seed": 3,
            "stop": ["\n\n"], "stream": True, "stream_options": {"include_usage": True}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200
    chunks = events(r.text)
    assert r.text.endswith("data: [DONE]\n\n") and not any("error" in c for c in chunks)
    assert {c["id"] for c in chunks} == {"cmpl-7f"}  # the first worker's stream id, to the end
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " 1, 2, 3, 4"
    assert not any("token_ids" in choice or "prompt_token_ids" in choice for c in chunks for choice in c["choices"])
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finish] == ["length"]
    last = chunks[-1]
    assert last["usage"] == {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}
    first = next(s for s in (a, b) if any(x.path == "/v1/completions" and isinstance(x.body["prompt"], str)
                                          for x in s.received))
    other = b if first is a else a
    [resumed] = [x for x in first.received + other.received if x.path == "/v1/completions"
                 and isinstance(x.body["prompt"], list)]
    assert resumed in other.received  # never the worker that failed
    rid = resumed.body.pop("rid")
    assert rid.endswith("-r1")
    assert resumed.body == {"model": "llama-3.1-8b", "temperature": 0, "seed": 3, "stop": ["\n\n"],
                            "prompt": [5, 6, 7, 8, 352, 28, 360, 28], "max_tokens": 3, "stream": True,
                            "stream_options": {"include_usage": True}, "return_token_ids": True,
                            "return_spec_tokens_details": True}
    assert last["specgate"]["resumed"] == {"count": 1, "steps": [
        {"at_token": 4, "from_worker": first.url, "to_worker": other.url, "pool": "plain", "outcome": "ok"}]}
    metrics = client.get("/metrics").text
    assert 'specgate_resumes_total{outcome="ok",pool="plain",route="default"} 1.0' in metrics


def test_an_sglang_chat_stream_is_not_resumed_it_sends_its_ids_only_at_the_end(stand_ins):
    client, a, b = stand_ins
    body = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7,
            "temperature": 0, "stream": True}
    r = client.post("/v1/chat/completions", json=body)
    chunks = events(r.text)
    assert r.text.endswith("data: [DONE]\n\n")
    assert chunks[-1]["error"]["message"].endswith("; not resumed: no_ids")
    assert not any(x.path == "/v1/completions" for x in a.received + b.received)
    metrics = client.get("/metrics").text
    assert 'specgate_resumes_total{outcome="no_ids",pool="plain",route="default"} 1.0' in metrics


@pytest.mark.parametrize("stand_ins", ["{max_resumes: 1, deadline_s: 0.000001}"], indirect=True)
def test_no_resume_after_the_deadline(stand_ins):
    client, a, b = stand_ins
    body = {"model": "llama-3.1-8b", "prompt": "Count:", "max_tokens": 7, "temperature": 0, "stream": True}
    r = client.post("/v1/completions", json=body)
    chunks = events(r.text)
    assert r.text.endswith("data: [DONE]\n\n")
    assert chunks[-1]["error"]["message"].endswith("; not resumed: deadline")
    assert not any(isinstance(x.body["prompt"], list) for x in a.received + b.received if x.path == "/v1/completions")
    metrics = client.get("/metrics").text
    assert 'specgate_resumes_total{outcome="deadline",pool="plain",route="default"} 1.0' in metrics


def test_a_whole_completions_answer_is_streamed_from_its_worker_and_resumes(stand_ins):
    """``resume.whole_answers`` (the default): the gateway asks the worker for a stream, assembles the whole body,
    and resumes it on the other worker when the first drops mid-answer."""
    client, a, b = stand_ins
    body = {"model": "llama-3.1-8b", "prompt": "Count:", "max_tokens": 7, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    whole = r.json()
    first = next(s for s in (a, b) if any(x.path == "/v1/completions" and isinstance(x.body["prompt"], str)
                                          for x in s.received))
    other = b if first is a else a
    [asked] = [x for x in first.received if x.path == "/v1/completions"]
    assert asked.body["stream"] is True and asked.body["return_token_ids"] is True
    specgate = whole.pop("specgate")
    assert whole == {"id": "cmpl-7f", "object": "text_completion", "created": 1761800011,
                     "model": "SmolLM2-135M-Instruct",
                     "choices": [{"index": 0, "text": " 1, 2, 3, 4", "logprobs": None, "finish_reason": "length",
                                  "matched_stop": None}],
                     "usage": {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11},
                     "sglext": {"spec_tokens_details": {
                         "spec_accept_rate": 0.5, "spec_accept_length": 1.5, "spec_num_correct_drafts": 1,
                         "spec_num_proposed_drafts": 2, "spec_verify_ct": 2, "spec_correct_drafts_histogram": [1, 1],
                         "spec_cap_lens_histogram": []}}}
    assert specgate["resumed"] == {"count": 1, "steps": [
        {"at_token": 4, "from_worker": first.url, "to_worker": other.url, "pool": "plain", "outcome": "ok"}]}


@pytest.mark.parametrize("stand_ins", ["{max_resumes: 1, whole_answers: false}"], indirect=True)
def test_without_whole_answers_a_whole_answer_is_asked_for_whole(stand_ins):
    client, a, b = stand_ins
    r = client.post("/v1/completions", json={"model": "llama-3.1-8b", "prompt": "Count:", "max_tokens": 7})
    [asked] = [x for x in a.received + b.received if x.path == "/v1/completions"][:1]
    assert asked.body["stream"] is False and "return_token_ids" not in asked.body
    assert r.status_code != 200  # the stand-in answers every request with a stream, which is no whole answer


def test_a_whole_sglang_chat_answer_is_asked_for_whole_it_could_not_resume(stand_ins):
    """SGLang's chat streams carry no ids (a resume would be refused: no_ids), so a whole chat answer from an SGLang
    pool is asked for whole, and a worker failure is served again from token 0 by dispatch's retry."""
    client, a, b = stand_ins
    client.post("/v1/chat/completions", json={"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 7})
    asked = [x for x in a.received + b.received if x.path == "/v1/chat/completions"]
    assert asked and all(x.body["stream"] is False for x in asked)
