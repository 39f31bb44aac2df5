"""Logprobs through the worker's three endpoints (tiny model, in-process): shapes, streaming, refusals.

The numbers themselves are checked against a teacher-forced forward in tests/engine/test_logprobs.py;
here: every endpoint reports the engine's numbers for every output token, in SGLang's or OpenAI's shape,
streamed chunks add up to the whole response, and speculation does not change them.
"""

from __future__ import annotations

import pytest

from tests.worker.worker_helpers import REPEAT, sse as _sse

NGRAM = {"speculation": {"proposer": "ngram", "draft_tokens": 4}}


def _tokens(real_tokenizer, ids: list[int]) -> list[str]:
    return [real_tokenizer.decode([i]) for i in ids]


def test_generate_reports_sglang_output_logprobs(worker, real_tokenizer):
    body = {"text": REPEAT, "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}}
    out = worker.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert [text for _, _, text in meta["output_token_logprobs"]] == _tokens(real_tokenizer, out["output_ids"])
    assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
    tops = meta["output_top_logprobs"]
    assert [len(top) for top in tops] == [2] * 9
    # greedy: the committed token is its position's most likely one
    assert [top[0] for top in tops] == meta["output_token_logprobs"]
    assert all(top[0][0] >= top[1][0] for top in tops)

    spec = worker.post("/generate", json={**body, "sampling_params": {**body["sampling_params"],
                                                                      "custom_params": NGRAM}}).json()
    assert spec["meta_info"]["spec_num_proposed_drafts"] > 0
    assert [t for _, t, _ in spec["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    for (a, _, _), (b, _, _) in zip(spec["meta_info"]["output_token_logprobs"], meta["output_token_logprobs"]):
        assert a == pytest.approx(b, abs=1e-4)

    terse = worker.post("/generate", json={**body, "top_logprobs_num": 0, "return_text_in_logprobs": False}).json()
    assert "output_top_logprobs" not in terse["meta_info"]
    assert all(text is None for _, _, text in terse["meta_info"]["output_token_logprobs"])
    assert "output_token_logprobs" not in worker.post("/generate", json={**body, "return_logprob": False}).json()[
        "meta_info"]
    chunks = _sse(worker.post("/generate", json={**body, "stream": True}))
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]  # cumulative


def test_chat_logprobs_in_openai_shape_and_streamed(worker, real_tokenizer):
    body = {"messages": [{"role": "user", "content": REPEAT}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 3, "custom_params": NGRAM}
    out = worker.post("/v1/chat/completions", json=body).json()
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 8
    # a token may hold part of a character: its bytes are exact, its text escapes them
    joined = b"".join(bytes(entry["bytes"]) for entry in content)
    assert joined.decode(errors="replace") == out["choices"][0]["message"]["content"]
    for entry in content:
        assert bytes(entry["bytes"]).decode(errors="backslashreplace") == entry["token"]
        assert [alt["token"] for alt in entry["top_logprobs"]][0] == entry["token"]
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["logprob"] == entry["logprob"]

    stream = _sse(worker.post("/v1/chat/completions", json={**body, "stream": True}))
    streamed = [entry for c in stream if c["choices"] and c["choices"][0]["logprobs"]
                for entry in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-4)
    bare = worker.post("/v1/chat/completions", json={**body, "top_logprobs": None}).json()
    assert all(entry["top_logprobs"] == [] for entry in bare["choices"][0]["logprobs"]["content"])
    assert worker.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}).json()[
        "choices"][0]["logprobs"] is None


def test_completion_logprobs_in_openai_shape_and_streamed(worker):
    body = {"prompt": REPEAT, "max_tokens": 7, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    out = worker.post("/v1/completions", json=body).json()
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(7)]
    assert [len(top) for top in lp["top_logprobs"]] == [2] * 7
    assert all(top[token] == value for top, token, value in zip(lp["top_logprobs"], lp["tokens"],
                                                                 lp["token_logprobs"]))
    stream = _sse(worker.post("/v1/completions", json={**body, "stream": True}))
    parts = [c["choices"][0]["logprobs"] for c in stream if c["choices"][0]["logprobs"]["tokens"]]
    assert [t for p in parts for t in p["tokens"]] == lp["tokens"]
    assert [o for p in parts for o in p["text_offset"]] == lp["text_offset"]


def test_generate_reports_prompt_logprobs_from_logprob_start_len(worker, real_tokenizer):
    prompt_ids = real_tokenizer.encode(REPEAT, add_special_tokens=False)
    body = {"input_ids": prompt_ids, "return_logprob": True, "top_logprobs_num": 1,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    whole = worker.post("/generate", json={**body, "logprob_start_len": 0}).json()["meta_info"]
    assert [t for _, t, _ in whole["input_token_logprobs"]] == prompt_ids
    assert whole["input_token_logprobs"][0][0] is None and whole["input_top_logprobs"][0] is None
    assert all(lp <= 0 for lp, _, _ in whole["input_token_logprobs"][1:])
    assert all(len(top) == 1 for top in whole["input_top_logprobs"][1:])
    tail = worker.post("/generate", json={**body, "logprob_start_len": 3}).json()["meta_info"]
    assert tail["input_token_logprobs"] == whole["input_token_logprobs"][3:]
    assert "input_token_logprobs" not in worker.post("/generate", json=body).json()["meta_info"]  # -1


def test_completions_echo_with_logprobs_scores_the_prompt_then_the_completion(worker):
    body = {"prompt": REPEAT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 1}
    out = worker.post("/v1/completions", json=body).json()
    choice, prompt_tokens = out["choices"][0], out["usage"]["prompt_tokens"]
    lp = choice["logprobs"]
    assert choice["text"].startswith(REPEAT) and "".join(lp["tokens"]) == choice["text"]
    assert len(lp["tokens"]) == prompt_tokens + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    stream = _sse(worker.post("/v1/completions", json={**body, "stream": True}))
    first = stream[0]["choices"][0]
    assert first["text"] == REPEAT and len(first["logprobs"]["tokens"]) == prompt_tokens
    streamed = [c["choices"][0]["logprobs"] for c in stream if c["choices"][0]["logprobs"]["tokens"]]
    assert [t for p in streamed for t in p["tokens"]] == lp["tokens"]
    assert [o for p in streamed for o in p["text_offset"]] == lp["text_offset"]


@pytest.mark.parametrize(("path", "extra", "field"), [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/generate", {"return_logprob": True, "logprob_start_len": 10**6}, "logprob_start_len"),
    ("/generate", {"return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
])
def test_bad_logprob_fields_are_refused_naming_the_field(worker, path, extra, field):
    base = {"/generate": {"text": REPEAT}, "/v1/completions": {"prompt": REPEAT},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": REPEAT}]}}[path]
    response = worker.post(path, json={**base, **extra})
    assert response.status_code == 400, response.text
    assert field in response.text
