"""Token ids on the embedded worker's OpenAI endpoints, where SGLang 0.5.23 puts them (backends/sglang/token_ids.py):
chat in the response-level sglext (body, or the streamed sglext chunk), completions per choice (prompt ids on
the first chunk, each chunk's new ids). Only when asked; the client's Structs read every field back; the
gateway's reader gathers the same ids from a whole answer and from a stream."""

from __future__ import annotations

import msgspec
import pytest

from backends.sglang import openai_wire
from backends.sglang.token_ids import TokenIds, request_fields, strip
from tests.worker.worker_helpers import STREAM, assert_read_in_full, payloads

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Count: one two three"}], "max_tokens": 6,
        "temperature": 0, "ignore_eos": True, "return_spec_tokens_details": True}
COMPLETION = {"prompt": "Count: one two three", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _gathered(chunks: list[bytes], kind: type) -> TokenIds:
    ids = TokenIds()
    for raw in chunks:
        ids.take(msgspec.json.decode(raw, type=kind))
    return ids


def test_chat_ids_in_sglext_whole_and_streamed(worker, real_tokenizer):
    body = {**CHAT, **request_fields(chat=True)}
    whole = worker.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    ext, usage = answer["sglext"], answer["usage"]
    expected = real_tokenizer.apply_chat_template(CHAT["messages"], tokenize=True, add_generation_prompt=True)
    assert ext["input_ids"] == list(getattr(expected, "input_ids", expected))
    assert len(ext["input_ids"]) == usage["prompt_tokens"]
    assert len(ext["output_ids"]) == 1 and len(ext["output_ids"][0]) == usage["completion_tokens"] == 6
    assert "spec_tokens_details" in ext
    assert_read_in_full(whole.content, openai_wire.ChatCompletionResponse)
    chunks = payloads(worker.post("/v1/chat/completions", json={**body, **STREAM}))
    for chunk in chunks:
        assert_read_in_full(chunk, openai_wire.ChatCompletionChunk)
    with_ids = [c for c in chunks if b"input_ids" in c]
    assert len(with_ids) == 1 and msgspec.json.decode(with_ids[0])["choices"] == []  # the sglext chunk
    streamed = _gathered(chunks, openai_wire.ChatCompletionChunk)
    assert (streamed.prompt_ids, streamed.output_ids) == (ext["input_ids"], ext["output_ids"][0])


def test_chat_ids_only_when_asked(worker):
    plain = worker.post("/v1/chat/completions", json={**CHAT, "return_spec_tokens_details": False}).json()
    assert "sglext" not in plain
    only_output = worker.post("/v1/chat/completions", json={**CHAT, "return_spec_tokens_details": False,
                                                            "return_output_ids_in_sglext": True}).json()
    assert set(only_output["sglext"]) == {"output_ids"}
    chunks = payloads(worker.post("/v1/chat/completions", json={**CHAT, **STREAM}))
    assert not any(b"_ids" in c for c in chunks)


@pytest.mark.parametrize("echo", [False, True])
def test_completion_ids_per_choice_whole_and_streamed(worker, real_tokenizer, echo):
    body = {**COMPLETION, "echo": echo, **request_fields(chat=False)}
    whole = worker.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    choice, usage = whole.json()["choices"][0], whole.json()["usage"]
    assert choice["prompt_token_ids"] == real_tokenizer(COMPLETION["prompt"])["input_ids"]
    assert len(choice["prompt_token_ids"]) == usage["prompt_tokens"]
    assert len(choice["token_ids"]) == usage["completion_tokens"] == 6
    assert_read_in_full(whole.content, openai_wire.CompletionResponse)
    chunks = payloads(worker.post("/v1/completions", json={**body, **STREAM}))
    for chunk in chunks:
        assert_read_in_full(chunk, openai_wire.CompletionResponse)
    assert sum(b"prompt_token_ids" in c for c in chunks) == 1
    streamed = _gathered(chunks, openai_wire.CompletionResponse)
    assert (streamed.prompt_ids, streamed.output_ids) == (choice["prompt_token_ids"], choice["token_ids"])
    plain = worker.post("/v1/completions", json={**COMPLETION, "echo": echo}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_strip_takes_the_ids_out_and_nothing_else(worker):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        asked = worker.post(path, json={**body, **request_fields(chat="chat" in path)})
        plain = worker.post(path, json=body)
        stripped = msgspec.json.decode(strip(asked.content))
        expected = plain.json()
        for answer in (stripped, expected):  # differ only in what is generated per request
            answer.pop("id"), answer.pop("created")
            answer.get("sglext", {}).pop("spec_tokens_details", None)
            if answer.get("sglext") == {}:
                answer.pop("sglext")
        assert stripped == expected
    untouched = b'{"choices":[{"text":"a"}]}'
    assert strip(untouched) is untouched
