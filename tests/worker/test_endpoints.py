"""Response shapes of every endpoint, streaming, and per-request speculation (tiny model, in-process)."""

from __future__ import annotations

import msgspec
import pytest

from backends.sglang.pair import PairIdentity
from backends.sglang.wire import ServerInfo
from tests.worker.worker_helpers import REPEAT, sse as _sse

META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version"}
SPEC_KEYS = {"spec_verify_ct", "spec_accept_length", "spec_accept_rate", "spec_num_correct_drafts",
             "spec_num_proposed_drafts", "spec_correct_drafts_histogram", "spec_accepted_per_position",
             "spec_proposed_per_position", "spec_chosen_per_k", "spec_draft_s", "spec_verify_s",
             "specgate_plain_ratio", "specgate_neighbour_s"}
TIMING_KEYS = {"specgate_first_token_s", "specgate_decode_s"}  # also in sglext.spec_tokens_details


def _sane_timings(fields: dict, e2e: float | None = None) -> None:
    """The engine's own clock: first token (after the queue) then decode, adding up to the e2e latency."""
    first, decode = fields["specgate_first_token_s"], fields["specgate_decode_s"]
    assert 0 < first and decode >= 0
    if "queue_time" in fields:
        assert 0 <= fields["queue_time"] <= first
    if e2e is not None:
        assert first <= e2e and abs(first + decode - e2e) < 1e-9


def _generate(worker, speculation=None, **sampling):
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, **sampling}
    if speculation is not None:
        sp["custom_params"] = {"speculation": speculation}
    response = worker.post("/generate", json={"text": REPEAT, "sampling_params": sp})
    assert response.status_code == 200, response.text
    return response.json()


def test_generate_body_and_meta_info(worker, real_tokenizer):
    response = worker.post("/generate", json={"text": REPEAT, "rid": "r-1", "sampling_params": {
        "max_new_tokens": 7, "temperature": 0, "ignore_eos": True}})
    body = response.json()
    meta = body["meta_info"]
    assert set(meta) == META_KEYS | SPEC_KEYS | TIMING_KEYS | {"e2e_latency", "queue_time",
                                                               "spec_reached_per_position"}
    _sane_timings(meta, meta["e2e_latency"])
    assert meta["id"] == "r-1"
    assert meta["finish_reason"] == {"type": "length", "length": 7}
    assert meta["prompt_tokens"] == len(real_tokenizer.encode(REPEAT, add_special_tokens=False))
    assert meta["completion_tokens"] == len(body["output_ids"]) == 7
    assert body["text"] == real_tokenizer.decode(body["output_ids"], skip_special_tokens=True)
    # plain decoding (the worker was started without speculation): one token per verification round
    assert meta["spec_verify_ct"] == 7 and meta["spec_accept_length"] == 1.0
    assert meta["spec_num_proposed_drafts"] == 0 and meta["spec_correct_drafts_histogram"] == [7]
    assert meta["specgate_plain_ratio"] == pytest.approx(1.0)  # plain decoding's estimate of itself
    assert meta["specgate_neighbour_s"] == 0.0  # no drafts, and no other sequence beside it
    assert meta["weight_version"] == "default" and meta["e2e_latency"] > 0


def test_per_request_speculation_keeps_greedy_output_and_reports_drafts(worker):
    plain = _generate(worker)
    for speculation in ({"proposer": "ngram", "draft_tokens": 3}, {"proposer": "draft_model", "draft_tokens": 2},
                        {"proposer": "ngram", "draft_tokens": 4, "adaptive": True},
                        {"proposer": "ngram", "draft_tokens": 4, "adaptive": True, "strategy": "sglang"},
                        {"proposer": "ngram", "draft_tokens": 4, "adaptive": True, "strategy": "vllm",
                         "k_by_batch": [[1, 2]]}):
        spec = _generate(worker, speculation)
        assert spec["output_ids"] == plain["output_ids"], speculation
        meta = spec["meta_info"]
        if not speculation.get("adaptive"):  # adaptive may rightly choose k = 0 on an uncalibrated engine
            assert meta["spec_num_proposed_drafts"] > 0, speculation
        assert sum(meta["spec_correct_drafts_histogram"]) == meta["spec_verify_ct"]
        assert meta["spec_num_correct_drafts"] == sum(meta["spec_accepted_per_position"])
        assert meta["spec_num_proposed_drafts"] == sum(meta["spec_proposed_per_position"])
        assert len(meta["spec_proposed_per_position"]) <= speculation["draft_tokens"]
        assert meta["spec_accept_length"] == meta["completion_tokens"] / meta["spec_verify_ct"]
        assert meta["specgate_plain_ratio"] > 0  # the engine's estimate of plain decoding's time over this one's
        chosen = meta["spec_chosen_per_k"]  # rounds per draft length asked for: what the controller picked
        assert sum(chosen) == meta["spec_verify_ct"] and len(chosen) <= speculation["draft_tokens"] + 1
        if speculation.get("strategy") == "vllm":  # one request running: the table's k = 2, fewer where the
            assert len(chosen) <= 3 and len(meta["spec_proposed_per_position"]) <= 2  # n-gram found fewer
        assert meta["spec_accept_rate"] == (meta["spec_num_correct_drafts"] / meta["spec_num_proposed_drafts"]
                                            if meta["spec_num_proposed_drafts"] else 0.0)


def test_worker_default_speculation_applies_without_override(worker_factory):
    with worker_factory(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3) as worker:
        info = worker.get("/server_info").json()
        assert (info["speculative_algorithm"], info["speculative_num_draft_tokens"]) == ("NGRAM", 3)
        default = _generate(worker)["meta_info"]
        assert default["spec_num_proposed_drafts"] > 0
        assert len(default["spec_proposed_per_position"]) == 3
        drafted = worker.get("/server_info").json()["specgate_draft_token_s"]  # what the rounds' lookups cost
        assert list(drafted) == ["ngram"] and drafted["ngram"] > 0
        bypass = _generate(worker, {"proposer": "none"})["meta_info"]
        assert bypass["spec_num_proposed_drafts"] == 0


def test_server_info_reports_the_step_budget_and_the_measured_step_costs(worker_factory):
    with worker_factory(max_batch_tokens=40, chunked_prefill_size=16) as worker:
        info = worker.get("/server_info").json()
        assert (info["chunked_prefill_size"], info["specgate_max_batch_tokens"]) == (16, 40)
        assert all(tokens == 1 for _, tokens, _ in info["specgate_step_costs"])  # uncalibrated: health checks only
        assert info["specgate_step_costs_context"] is None  # no start-up calibration: no context to report
        prompt = " ".join(["word"] * 40)  # > 16 tokens: prefilled in chunks of 16
        assert worker.post("/generate", json={"text": prompt, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}).status_code == 200
        costs = {(seqs, tokens): s for seqs, tokens, s in worker.get("/server_info").json()["specgate_step_costs"]}
        assert (1, 16) in costs and (1, 1) in costs  # a prefill chunk and a plain round, one sequence each
        assert all(s > 0 for s in costs.values()) and max(tokens for _, tokens in costs) == 16
        info = worker.get("/server_info").json()
        assert info["specgate_draft_token_s"] == {} and info["specgate_round_overhead_s"] > 0  # plain rounds only


def test_generate_stream_is_cumulative_and_ends_with_done(worker):
    response = worker.post("/generate", json={"text": REPEAT, "stream": True, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert response.status_code == 200  # not Litestar's POST default 201: smg forwards it verbatim
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(response)
    assert len(chunks) == 6
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None and "e2e_latency" not in c["meta_info"]
               and not TIMING_KEYS & set(c["meta_info"]) for c in chunks[:-1])
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"] == {"type": "length", "length": 6} and final["spec_verify_ct"] == 6
    _sane_timings(final, final["e2e_latency"])
    assert _generate(worker, max_new_tokens=6)["text"] == chunks[-1]["text"]


def test_stop_string_finish_reason(worker):
    free = _generate(worker, max_new_tokens=8)["text"]
    stop = free[3:6]
    meta = _generate(worker, max_new_tokens=8, stop=[stop])
    assert meta["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert meta["text"] == free[:free.index(stop)]


def test_chat_completion_with_spec_details(worker):
    body = {"model": "anything", "messages": [{"role": "user", "content": REPEAT}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "return_spec_tokens_details": True,
            "custom_params": {"speculation": {"proposer": "ngram", "draft_tokens": 2}}}
    out = worker.post("/v1/chat/completions", json=body).json()
    assert out["object"] == "chat.completion" and out["model"] == "anything"
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 5
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 5
    details = out["sglext"]["spec_tokens_details"]
    assert details["spec_verify_ct"] >= 3 and details["spec_num_proposed_drafts"] > 0
    assert {"spec_cap_length", "spec_block_accept_length", "spec_cap_lens_histogram"} <= set(details)
    assert TIMING_KEYS <= set(details) and "queue_time" not in details  # queue_time: meta_info's (SGLang)
    _sane_timings(details)
    assert "sglext" not in worker.post("/v1/chat/completions", json={**body, "return_spec_tokens_details": False}).json()

    stream = _sse(worker.post("/v1/chat/completions", json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}}))
    assert stream[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in stream if c["choices"])
    assert text == choice["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in stream if c["choices"]][-1] == "length"
    sglext, usage = stream[-2], stream[-1]
    assert sglext["choices"] == [] and sglext["sglext"]["spec_tokens_details"]["spec_verify_ct"] == details["spec_verify_ct"]
    _sane_timings(sglext["sglext"]["spec_tokens_details"])
    assert usage["choices"] == [] and usage["usage"] == out["usage"]


def test_chat_tools_are_rendered_into_the_prompt(worker):
    base = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 1, "temperature": 0}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    plain = worker.post("/v1/chat/completions", json=base).json()["usage"]["prompt_tokens"]
    with_tools = worker.post("/v1/chat/completions", json={**base, "tools": tools}).json()["usage"]["prompt_tokens"]
    assert with_tools > plain


def test_completions_plain_and_stream(worker):
    body = {"prompt": REPEAT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "echo": False}
    out = worker.post("/v1/completions", json=body).json()
    assert out["object"] == "text_completion" and out["choices"][0]["finish_reason"] == "length"
    assert out["choices"][0]["text"] == _generate(worker, max_new_tokens=5)["text"]
    stream = _sse(worker.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in stream) == out["choices"][0]["text"]
    assert all(c["object"] == "text_completion" for c in stream)


def test_completions_echo_the_prompt_as_sent(worker, real_tokenizer):
    body = {"prompt": REPEAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    text = worker.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert worker.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]["text"] == REPEAT + text
    stream = _sse(worker.post("/v1/completions", json={**body, "echo": True, "stream": True}))
    assert stream[0]["choices"][0]["text"] == REPEAT
    assert "".join(c["choices"][0]["text"] for c in stream) == REPEAT + text
    ids = real_tokenizer.encode(REPEAT, add_special_tokens=False)
    echoed = worker.post("/v1/completions", json={**body, "prompt": ids, "echo": True}).json()["choices"][0]["text"]
    assert echoed == real_tokenizer.decode(ids) + text


def test_info_endpoints(worker, prepared_model):
    models = worker.get("/v1/models").json()["data"]
    assert models == [{"id": "SmolLM2-135M-Instruct", "object": "model", "created": models[0]["created"],
                       "owned_by": "sglang", "root": "SmolLM2-135M-Instruct", "parent": None,
                       "max_model_len": 512}]
    for path in ("/server_info", "/get_server_info"):
        info = worker.get(path).json()
        assert info["model_path"] == str(prepared_model.path) and info["revision"] == prepared_model.revision
        assert info["speculative_algorithm"] is None and info["specgate_per_request_speculation"] is True
        assert info["context_length"] == 512 and info["internal_states"][0]["avg_spec_accept_length"] >= 0
    for path in ("/model_info", "/get_model_info"):
        assert worker.get(path).json()["architectures"] == ["LlamaForCausalLM"]
    loads = worker.get("/v1/loads", params={"include": "core,memory"}).json()
    assert isinstance(loads["timestamp"], str) and loads["dp_rank_count"] == 1
    rank = loads["loads"][0]
    assert (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["token_usage"]) == (0, 0, 0.0)
    assert rank["max_total_num_tokens"] == 65536


def test_metrics_use_sglang_names(worker):
    _generate(worker, max_new_tokens=3)
    text = worker.get("/metrics").text
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:spec_accept_length", "sglang:spec_accept_rate", "sglang:time_to_first_token_seconds",
                 "sglang:inter_token_latency_seconds", "sglang:e2e_request_latency_seconds",
                 "sglang:generation_tokens_total", "sglang:prompt_tokens_total"):
        assert f"\n{name}" in text, name
    assert 'sglang:num_running_reqs{model_name="SmolLM2-135M-Instruct"} 0.0' in text


def test_served_model_name_and_weight_version(worker_factory, prepared_model):
    with worker_factory(served_model_name="smol", weight_version="v7", speculative_algorithm="STANDALONE") as w:
        info = w.get("/server_info").json()
        assert (info["served_model_name"], info["weight_version"]) == ("smol", "v7")
        assert info["speculative_draft_model_path"] == f"{prepared_model.path}#layers=1"
        assert info["speculative_draft_model_revision"] == prepared_model.revision
        assert w.get("/v1/models").json()["data"][0]["id"] == "smol"
        assert _generate(w, max_new_tokens=2)["meta_info"]["weight_version"] == "v7"


DEFAULT_SPEC_ARGS = {
    "speculative_ngram_min_match_window_size": 1, "speculative_ngram_max_match_window_size": 12,
    "speculative_ngram_match": "earliest", "speculative_suffix_max_tree_depth": 24,
    "speculative_suffix_max_cached_requests": 1000, "speculative_suffix_max_spec_factor": 1.0,
    "speculative_suffix_min_token_prob": 0.1, "speculative_suffix_max_scopes": 64,
}
LAUNCHED_SPEC_ARGS = {
    "speculative_ngram_min_match_window_size": 2, "speculative_ngram_max_match_window_size": 4,
    "speculative_ngram_match": "latest", "speculative_suffix_max_tree_depth": 16,
    "speculative_suffix_max_cached_requests": 10, "speculative_suffix_max_spec_factor": 2.5,
    "speculative_suffix_min_token_prob": 0.25, "speculative_suffix_max_scopes": 3,
}


def test_server_info_reports_ngram_and_suffix_settings_as_server_args(worker, worker_factory):
    info = worker.get("/server_info").json()
    assert {key: info[key] for key in DEFAULT_SPEC_ARGS} == DEFAULT_SPEC_ARGS
    with worker_factory(speculative_algorithm="SUFFIX", **LAUNCHED_SPEC_ARGS) as w:
        response = w.get("/server_info")
        info = response.json()
        assert info["speculative_algorithm"] == "SUFFIX"
        assert {key: info[key] for key in LAUNCHED_SPEC_ARGS} == LAUNCHED_SPEC_ARGS
        # the gateway's reading of the same body: the pair identity's draft params, keyed as the policy keys them
        identity = PairIdentity.from_info(msgspec.json.decode(response.content, type=ServerInfo), None)
        assert (identity.algorithm, identity.per_request_speculation) == ("SUFFIX", True)
        assert identity.draft_params == (
            ("match", "latest"), ("max_cached_requests", 10), ("max_match_window_size", 4), ("max_scopes", 3),
            ("max_spec_factor", 2.5), ("max_tree_depth", 16), ("min_match_window_size", 2), ("min_token_prob", 0.25))


def test_suffix_proposer_with_a_scope_is_served_with_the_plain_greedy_output(worker):
    plain = _generate(worker)
    spec = _generate(worker, {"proposer": "suffix", "draft_tokens": 4, "scope": "ide"})
    assert spec["output_ids"] == plain["output_ids"]
    meta = spec["meta_info"]
    assert sum(meta["spec_correct_drafts_histogram"]) == meta["spec_verify_ct"]
    assert len(meta["spec_proposed_per_position"]) <= 4
