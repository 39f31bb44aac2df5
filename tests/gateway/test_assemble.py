"""A whole answer assembled from its worker's stream (gateway.relay.assemble, ``resume.whole_answers``): the body the
worker would have answered whole, and a failure after the finishing chunk is never resumed (gateway.relay.continued).
The same through the real app: tests/gateway/test_resume.py; with real workers: tests/integration/test_gateway_resume.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from backends.sglang.client import OpenAIResult
from backends.sglang.errors import WorkerStreamError
from backends.sglang.openai_wire import ChatCompletionChunk, CompletionResponse
from gateway.holds import Stopwatch
from gateway.relay import Tally, assemble


def chunk(kind: type, body: dict[str, Any]) -> OpenAIResult[Any]:
    raw = json.dumps(body).encode()
    return OpenAIResult(raw, msgspec.json.decode(raw, type=kind))


async def upstream(items: list[Any]):
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


def build(endpoint: str, items: list[Any], resumer: Any = None) -> dict[str, Any]:
    admitted = SimpleNamespace(arrival=SimpleNamespace(endpoint=endpoint))  # assemble reads the endpoint only
    stream = upstream(items[1:])
    body = asyncio.run(assemble(Tally(0.0), admitted, stream, items[0], lambda: b'{"request_id":"r"}', Stopwatch(),
                                resumer))
    return json.loads(body)


def test_a_completions_answer_joins_its_texts_and_logprobs():
    head = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m"}
    body = build("completions", [
        chunk(CompletionResponse, {**head, "choices": [{"index": 0, "text": "Hel", "token_ids": [1], "logprobs": {
            "tokens": ["Hel"], "token_logprobs": [-0.1], "top_logprobs": [{"Hel": -0.1}], "text_offset": [0]}}]}),
        chunk(CompletionResponse, {**head, "choices": [{"index": 0, "text": "lo", "token_ids": [2], "logprobs": {
            "tokens": ["lo"], "token_logprobs": [-0.2], "top_logprobs": [{"lo": -0.2}], "text_offset": [3]},
            "finish_reason": "stop", "matched_stop": 7}]}),
        chunk(CompletionResponse, {**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                                                    "total_tokens": 5}})])
    assert body == {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m", "choices": [
        {"index": 0, "text": "Hello", "logprobs": {"tokens": ["Hel", "lo"], "token_logprobs": [-0.1, -0.2],
                                                   "top_logprobs": [{"Hel": -0.1}, {"lo": -0.2}],
                                                   "text_offset": [0, 3]},
         "finish_reason": "stop", "matched_stop": 7}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}, "specgate": {"request_id": "r"}}


def test_a_chat_answer_has_the_workers_message_shape_and_no_ids():
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}
    body = build("chat", [
        chunk(ChatCompletionChunk, {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                         "prompt_token_ids": [9, 9]}]}),
        chunk(ChatCompletionChunk, {**head, "choices": [{"index": 0, "delta": {"content": "Hi"}, "token_ids": [4],
                                                         "finish_reason": "length"}]})])
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hi", "reasoning_content": None,
                                                        "tool_calls": None},
                                "logprobs": None, "finish_reason": "length", "matched_stop": None}]
    assert body["object"] == "chat.completion" and "usage" not in body and "token_ids" not in json.dumps(body)


def test_a_failure_after_the_finishing_chunk_is_not_resumed():
    class Never:  # a resumer that must not be asked
        progress = None

        async def resume(self, exc: Exception) -> Any:
            raise AssertionError("resumed after the finishing chunk")

    head = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m"}
    done = chunk(CompletionResponse, {**head, "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})
    with pytest.raises(WorkerStreamError):
        build("completions", [done, WorkerStreamError("w", "reset", bytes_received=True)], resumer=Never())
