"""Every response the embedded worker produces, decoded with the Struct the client decodes it with, loses
nothing: each key the worker sent is a field of that Struct (recursively), and the Struct re-encodes to what
was sent. The worker builds these very Structs (``backends/sglang/wire.py``), so a field one side gains the
other has too, and none the worker sends is silently dropped by the client."""

from __future__ import annotations

import msgspec
import pytest

from backends.sglang import wire

from backends.sglang import openai_wire
from backends.worker.app import _stream_error
from backends.worker.errors import NotReady, Overloaded, error_body
from tests.worker.worker_helpers import REPEAT, STREAM, assert_read_in_full, lost, payloads

NGRAM = {"speculation": {"proposer": "ngram", "draft_tokens": 3}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": REPEAT}], "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "return_spec_tokens_details": True, "custom_params": NGRAM}
COMPLETION = {"prompt": REPEAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "echo": True,
              "return_spec_tokens_details": True, "custom_params": NGRAM}
GENERATE = {"text": REPEAT, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 2,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True, "custom_params": NGRAM}}


def test_generate_with_logprobs_and_speculation(worker):
    response = worker.post("/generate", json=GENERATE)
    assert response.status_code == 200, response.text
    assert {"output_top_logprobs", "input_token_logprobs", "spec_proposed_per_position"} <= set(
        response.json()["meta_info"])
    assert_read_in_full(response.content, wire.GenerateResponse)
    chunks = payloads(worker.post("/generate", json={**GENERATE, "stream": True}))
    assert len(chunks) == 5
    for chunk in chunks:
        assert_read_in_full(chunk, wire.GenerateResponse)


@pytest.mark.parametrize("logprobs", [False, True])
def test_chat_response_and_every_stream_chunk(worker, logprobs):
    body = {**CHAT, "logprobs": logprobs, "top_logprobs": 2 if logprobs else None}
    response = worker.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert_read_in_full(response.content, openai_wire.ChatCompletionResponse)
    chunks = payloads(worker.post("/v1/chat/completions", json={**body, **STREAM}))
    assert [bool(msgspec.json.decode(c)["choices"]) for c in chunks[-2:]] == [False, False]  # sglext, usage
    for chunk in chunks:
        assert_read_in_full(chunk, openai_wire.ChatCompletionChunk)


@pytest.mark.parametrize("logprobs", [None, 2])
def test_completion_response_and_every_stream_chunk(worker, logprobs):
    body = {**COMPLETION, "logprobs": logprobs}
    response = worker.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert_read_in_full(response.content, openai_wire.CompletionResponse)
    for chunk in payloads(worker.post("/v1/completions", json={**body, **STREAM})):
        assert_read_in_full(chunk, openai_wire.CompletionResponse)


@pytest.mark.parametrize(("path", "kind"), [
    ("/v1/loads", wire.LoadsResponse), ("/server_info", wire.ServerInfo), ("/model_info", wire.ModelInfo),
    ("/v1/models", wire.ModelList),
])
def test_load_and_identity(worker, path, kind):
    response = worker.get(path)
    assert response.status_code == 200, response.text
    assert_read_in_full(response.content, kind)


def test_abort(worker):
    assert_read_in_full(worker.post("/abort_request", json={"rid": "nobody"}).content, wire.AbortResponse)


def test_errors(worker):
    refused = worker.post("/generate", json={"text": "hi", "sampling_params": {"top_p": 5}})
    assert refused.status_code == 400
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}  # OpenAI's shape
    for raw in (refused.content, msgspec.json.encode(Overloaded("full").body()),
                msgspec.json.encode(NotReady("loading").body()),
                msgspec.json.encode(error_body("internal error: boom", "InternalServerError", 500))):
        assert_read_in_full(raw, wire.ErrorEnvelope)
    chunk = _stream_error("internal error: boom", 500)  # SGLang's mid-stream error: no param, retryable
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    assert set(msgspec.json.decode(chunk[6:])["error"]) == {"message", "type", "code", "retryable"}
    # not exact: a reader of this chunk gets ``param`` None, which re-encodes as the OpenAI shape's null
    assert_read_in_full(chunk[6:-2], wire.ErrorEnvelope, exact=False)


def test_the_check_names_a_dropped_field():
    """What the check would have said about the old drift (a key the client's Struct does not declare)."""
    raw = b'{"text": "a", "output_ids": [1], "meta_info": {"id": "r", "spec_verify_ct": 1, "spec_new": [1, 2]}}'
    read = msgspec.json.decode(msgspec.json.encode(msgspec.json.decode(raw, type=wire.GenerateResponse)))
    assert lost(msgspec.json.decode(raw), read) == ["$.meta_info.spec_new"]
    with pytest.raises(AssertionError, match="GenerateResponse drops what the worker sent"):
        assert_read_in_full(raw, wire.GenerateResponse)
