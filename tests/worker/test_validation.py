"""Bad input gets SGLang-style 400s naming the field; nothing a client sends crashes the worker."""

from __future__ import annotations

import json

import pytest

from backends.engine.types import SpeculationParams
from backends.worker.errors import BadRequest
from backends.worker.translate import speculation

G = "/generate"
C = "/v1/chat/completions"
P = "/v1/completions"
OK_SP = {"max_new_tokens": 2}
CASES = [
    # (path, body, param, message fragment)
    (G, {"text": "hi", "sampling_params": {"max_new_token": 4}}, "sampling_params",
     "Object contains unknown field `max_new_token`"),
    (G, {"text": "", "sampling_params": OK_SP}, "text", "text is empty"),
    (G, {"text": "hi", "input_ids": [1, 2], "sampling_params": OK_SP}, "text", "Only one of text and input_ids"),
    (G, {"sampling_params": OK_SP}, "text", "Either text or input_ids"),
    (G, {"input_ids": [], "sampling_params": OK_SP}, "input_ids", "input_ids is empty"),
    (G, {"input_ids": [10**9]}, "input_ids", "input_ids must be token ids in [0, 49152)"),
    (G, {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens",
     "must be at least 1, got -1"),
    (G, {"text": "hi", "sampling_params": {"top_p": 0}}, "sampling_params.top_p", "must be in (0, 1], got 0"),
    (G, {"text": "hi", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p", "must be in (0, 1], got 1.5"),
    (G, {"text": "hi", "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature",
     "must be non-negative"),
    (G, {"text": "hi", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature",
     "Expected `float`, got `str`"),
    (G, {"text": "hi", "sampling_params": {"n": 2}}, "sampling_params.n", "must be 1"),
    (G, {"text": "hi", "sampling_params": {"regex": "a+"}}, "sampling_params.regex", "is not supported"),
    (G, {"input_ids": [5] * 600, "sampling_params": OK_SP}, "text", "context window is 512"),
    (G, {"text": "hi", "sampling_params": {"custom_params": {"speculation": {"proposer": "eagle"}}}},
     "sampling_params.custom_params.speculation.proposer", "Invalid enum value 'eagle'"),
    (G, {"text": "hi", "sampling_params": {"custom_params": {"speculation": {"draft_tokens": 17}}}},
     "sampling_params.custom_params.speculation.draft_tokens", "Expected `int` <= 16"),
    (G, {"text": "hi", "sampling_params": {"custom_params": {"speculation": {"k": 3}}}},
     "sampling_params.custom_params.speculation", "Object contains unknown field `k`"),
    (G, {"text": "hi", "sampling_params": {"custom_params": {"speculation": "ngram"}}},
     "sampling_params.custom_params.speculation", "Expected `object`, got `str`"),
    (G, {"text": "hi", "sampling_params": {"custom_params": {"speculation": {"proposer": "suffix", "scope": 7}}}},
     "sampling_params.custom_params.speculation.scope", "Expected `str | null`, got `int`"),
    (G, {"text": "hi", "sampling_params": {"custom_params": {"speculation": {"ngram_max": 4}}}},
     "sampling_params.custom_params.speculation", "Object contains unknown field `ngram_max`"),
    (C, {"messages": []}, "messages", "messages is empty"),
    (C, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "must be one of"),
    (C, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content",
     "only text parts"),
    (C, {"messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p", "must be in (0, 1]"),
    (C, {"messages": [{"role": "user", "content": "x"}], "custom_params": {"speculation": {"adaptive": 1}}},
     "custom_params.speculation.adaptive", "Expected `bool | null`, got `int`"),
    (C, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format", "'json_object' needs constrained decoding"),
    (C, {"messages": [{"role": "user", "content": "x"}], "response_format": "json"}, "response_format",
     "Expected `object | null`, got `str`"),
    (C, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice",
     "'required' would force a tool call"),
    (C, {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": {
        "name": "f"}}}, "tool_choice", "would force a tool call"),
    (P, {"prompt": ""}, "prompt", "prompt is empty"),
    (P, {"prompt": "def f(", "suffix": "return 1"}, "suffix", "(fill-in-the-middle) is not supported"),
    (P, {"prompt": "x", "best_of": 3}, "best_of", "must be 1 on the specgate embedded engine, got 3"),
    (P, {"prompt": "x", "max_tokens": 0}, "max_new_tokens", "must be at least 1, got 0"),
    (P, {"model": "m"}, None, "Object missing required field `prompt`"),
]


@pytest.mark.parametrize(("path", "body", "param", "fragment"), CASES,
                         ids=[f"{c[0]}:{c[2]}:{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_a_400_naming_the_field(worker, path, body, param, fragment):
    response = worker.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert fragment in error["message"]
    assert error["type"] == "BadRequestError" and error["code"] == 400


@pytest.mark.parametrize("raw", [b"", b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_body_that_is_not_a_json_object_is_a_400(worker, raw):
    response = worker.post(G, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(("request body is not valid JSON",
                                                            "invalid request body: Expected `object`"))


def test_unknown_top_level_keys_are_ignored_like_sglang(worker):
    # the keys smg adds when it re-serialises /generate
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "model": "x", "return_text_in_logprobs": True, "log_metrics": True, "background": False,
            "no_logs": False, "return_bytes": False, "return_entropy": False, "whatever": {"a": 1}}
    response = worker.post(G, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["completion_tokens"] <= 2


def test_worker_survives_garbage_and_still_generates(worker):
    for payload in (b"null", b"1e999999", json.dumps({"text": "a" * 10, "sampling_params": None}).encode(),
                    json.dumps({"text": ["a", "b"]}).encode(), b'{"input_ids": [-1]}'):
        response = worker.post(G, content=payload)
        assert response.status_code == 400, payload
        assert response.json()["error"]["type"] == "BadRequestError", payload
    assert worker.post("/abort_request", json={"rid": "nope"}).json() == {"aborted": False}
    assert worker.get("/health_generate").status_code == 200


def test_free_text_response_format_and_unforced_tool_choice_are_served(worker):
    """Served as plain free text: a completion, never a parsed tool call; the tools are described to the
    model in its prompt (SmolLM2's template has no tools slot), so that prompt is longer."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    prompt_tokens = {}
    for name, extra in (("plain", {}), ("text", {"response_format": {"type": "text"}}),
                        ("auto", {"tools": tools, "tool_choice": "auto"}),
                        ("none", {"tools": tools, "tool_choice": "none"})):
        body = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 2, **extra}
        response = worker.post(C, json=body)
        assert response.status_code == 200, (name, response.text)
        answer = response.json()
        choice = answer["choices"][0]
        assert answer["object"] == "chat.completion" and choice["message"]["role"] == "assistant", name
        assert not choice["message"].get("tool_calls") and choice["finish_reason"] in ("stop", "length"), name
        assert 1 <= answer["usage"]["completion_tokens"] <= 2, name
        prompt_tokens[name] = answer["usage"]["prompt_tokens"]
    assert prompt_tokens["text"] == prompt_tokens["plain"]
    assert prompt_tokens["auto"] == prompt_tokens["none"] > prompt_tokens["plain"]


SHAPE = ("{proposer: none|ngram|draft_model|suffix|hybrid, draft_tokens: 1..16, adaptive: bool, "
         "strategy: beta|sglang|vllm, k_by_batch: [[lowest batch size, k], ...], prior: up to 16 rates in [0, 1], "
         "scope: string of at most 128 characters}")


@pytest.mark.parametrize(("path", "body", "param"), [
    (G, {"text": "hi", "sampling_params": {"custom_params": {"speculation": {"scope": "r" * 129}}}},
     "sampling_params.custom_params.speculation.scope"),
    (C, {"messages": [{"role": "user", "content": "x"}],
         "custom_params": {"speculation": {"proposer": "suffix", "scope": "r" * 129}}},
     "custom_params.speculation.scope"),
])
def test_a_scope_over_128_characters_is_a_400_that_says_what_to_send(worker, path, body, param):
    error = worker.post(path, json=body).json()["error"]
    assert (error["param"], error["message"]) == (param, f"{param} must be at most 128 characters, got 129; send a "
                                                         "shorter name (the gateway sends the route's name)")


def test_an_unknown_proposer_message_lists_every_proposer_incl_suffix(worker):
    body = {"text": "hi", "sampling_params": {"custom_params": {"speculation": {"proposer": "eagle"}}}}
    assert worker.post(G, json=body).json()["error"]["message"] == (
        f"invalid sampling_params.custom_params.speculation.proposer: Invalid enum value 'eagle'; expected {SHAPE}")


LAUNCH = SpeculationParams(proposer="ngram", draft_tokens=6, adaptive=True, ngram_min=2, ngram_max=5,
                           ngram_match="latest", scope="")


def test_override_merges_proposer_and_scope_and_keeps_the_launch_ngram_settings():
    merged = speculation({"speculation": {"proposer": "suffix", "scope": "ide"}}, LAUNCH, "")
    assert merged == SpeculationParams(proposer="suffix", draft_tokens=6, adaptive=True, ngram_min=2, ngram_max=5,
                                       ngram_match="latest", scope="ide")
    assert speculation({"speculation": {"draft_tokens": 3, "adaptive": False}}, LAUNCH, "") == SpeculationParams(
        proposer="ngram", draft_tokens=3, adaptive=False, ngram_min=2, ngram_max=5, ngram_match="latest")
    assert speculation({"speculation": {"scope": "r" * 128}}, LAUNCH, "").scope == "r" * 128
    assert speculation({"other": 1}, LAUNCH, "") is LAUNCH


def test_override_cannot_change_the_server_ngram_settings():
    with pytest.raises(BadRequest) as info:
        speculation({"speculation": {"ngram_match": "earliest"}}, LAUNCH, "sampling_params.")
    assert str(info.value) == ("invalid sampling_params.custom_params.speculation: Object contains unknown field "
                               f"`ngram_match`; expected {SHAPE}")


def test_override_carries_the_per_round_controller():
    merged = speculation({"speculation": {"strategy": "vllm", "k_by_batch": [[1, 8], [4, 2]]}}, LAUNCH, "")
    assert (merged.strategy, merged.k_by_batch, merged.adaptive) == ("vllm", ((1, 8), (4, 2)), True)
    mine = speculation({"speculation": {"strategy": "beta", "prior": [0.9, 0.5]}}, LAUNCH, "")
    assert (mine.strategy, mine.prior, mine.k_by_batch) == ("beta", (0.9, 0.5), ())


@pytest.mark.parametrize("override, param, message", [
    ({"strategy": "vllm"}, "custom_params.speculation.k_by_batch",
     "strategy vllm needs k_by_batch (vLLM's num_speculative_tokens_per_batch_size), e.g. [[1, 8], [4, 4]]"),
    ({"strategy": "vllm", "k_by_batch": [[4, 2], [1, 8]]}, "custom_params.speculation.k_by_batch",
     "must list [lowest batch size, k] pairs in ascending order of batch size, each size once, "
     "e.g. [[1, 8], [4, 4], [16, 0]]"),
    ({"proposer": "hybrid", "adaptive": True, "strategy": "sglang"}, "custom_params.speculation.strategy",
     "proposer hybrid picks its source and k with strategy beta, got sglang; send strategy beta or another proposer"),
])
def test_a_bad_controller_override_names_the_field(override, param, message):
    with pytest.raises(BadRequest) as info:
        speculation({"speculation": override}, LAUNCH, "")
    assert str(info.value) == f"{param} {message}"


def test_a_prior_out_of_range_is_refused_with_the_shape():
    with pytest.raises(BadRequest) as info:
        speculation({"speculation": {"prior": [1.5]}}, LAUNCH, "")
    assert str(info.value).startswith("invalid custom_params.speculation.prior[0]: Expected `float` <= 1.0")
