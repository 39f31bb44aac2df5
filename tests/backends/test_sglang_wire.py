"""Decoding of every recorded SGLang body, and spec-field normalisation across releases."""

from __future__ import annotations

import msgspec
import pytest

from backends.sglang.openai_wire import ChatCompletionResponse, CompletionResponse
from backends.sglang.spec_stats import SpecStats, spec_stats_from, spec_stats_from_sglext
from backends.sglang.wire import (
    ErrorEnvelope,
    ErrorDetail,
    GenerateRequest,
    GenerateResponse,
    LoadsResponse,
    MetaInfo,
    ModelInfo,
    SamplingParams,
    ServerInfo,
)
from tests.backends.replay_server import fixture_bytes


def decode(kind, name):
    return msgspec.json.decode(fixture_bytes(name), type=kind)


def test_generate_fixture_parses_exact_values():
    r = decode(GenerateResponse, "generate.json")
    m = r.meta_info
    assert r.text == " Paris. It is known for the Eiffel"
    assert len(r.output_ids) == 12 and r.output_ids[0] == 7042
    assert (m.id, m.prompt_tokens, m.completion_tokens, m.cached_tokens) == (
        "9f1c2a6e4b3d4c8e8a1f0b2c3d4e5f60", 7, 12, 0)
    assert m.finish_reason is not None and (m.finish_reason.type, m.finish_reason.length) == ("length", 12)
    assert m.weight_version == "default" and m.e2e_latency == 0.4213
    assert spec_stats_from(m) == SpecStats(
        verify_ct=5, accept_length=2.4, accept_rate=0.4666666666666667, num_correct_drafts=7,
        num_proposed_drafts=15, histogram=(1, 2, 1, 1))


def test_plain_generate_has_no_spec_stats():
    m = decode(GenerateResponse, "generate_plain.json").meta_info
    assert m.finish_reason is not None and (m.finish_reason.type, m.finish_reason.matched) == ("stop", 2)
    assert m.cached_tokens == 4
    assert spec_stats_from(m) is None


def test_legacy_spec_names_normalise():
    m = decode(GenerateResponse, "generate_spec_legacy.json").meta_info
    assert m.finish_reason is not None and m.finish_reason.matched == "\n\n"
    assert spec_stats_from(m) == SpecStats(
        verify_ct=5, accept_length=2.6, accept_rate=0.5333333333333333, num_correct_drafts=8,
        num_proposed_drafts=15, histogram=None)


def test_transitional_names_normalise_and_missing_length_is_derived():
    m = decode(GenerateResponse, "generate_spec_transitional.json").meta_info
    stats = spec_stats_from(m)
    # no spec_accept_length / rate in this release: (correct + rounds) / rounds, correct / proposed
    assert stats == SpecStats(verify_ct=3, accept_length=2.0, accept_rate=0.5, num_correct_drafts=3,
                              num_proposed_drafts=6, histogram=(0, 3, 0))


def test_canonical_names_win_over_aliases_and_specgate_extras_pass_through():
    m = msgspec.json.decode(
        b'{"id":"x","completion_tokens":5,"spec_verify_ct":2,"spec_num_correct_drafts":3,'
        b'"spec_accepted_drafts":99,"spec_accept_token_num":98,"spec_correct_drafts_histogram":[0,1,1],'
        b'"spec_accept_histogram":[9],"spec_accepted_per_position":[2,1],"spec_reached_per_position":[2,2],'
        b'"spec_draft_s":0.01,"spec_verify_s":0.02,"brand_new_field":{"a":1}}',
        type=MetaInfo)
    stats = spec_stats_from(m)
    assert stats is not None
    assert stats.num_correct_drafts == 3 and stats.histogram == (0, 1, 1)
    assert stats.accept_length == 2.5  # derived: (3 + 2) / 2
    assert stats.accept_rate is None  # nothing proposed was reported
    assert stats.accepted_per_position == (2, 1) and stats.reached_per_position == (2, 2)
    assert (stats.draft_s, stats.verify_s) == (0.01, 0.02)


def test_chat_and_completion_fixtures_parse_with_sglext():
    chat = decode(ChatCompletionResponse, "chat.json")
    assert chat.choices[0].message.content == "The capital of France is Paris."
    assert (chat.choices[0].finish_reason, chat.choices[0].matched_stop) == ("stop", 2)
    assert chat.usage is not None and (chat.usage.prompt_tokens, chat.usage.completion_tokens,
                                       chat.usage.total_tokens) == (31, 9, 40)
    assert spec_stats_from_sglext(chat.sglext) == SpecStats(
        verify_ct=4, accept_length=2.25, accept_rate=0.625, num_correct_drafts=5,
        num_proposed_drafts=8, histogram=(1, 1, 2))
    comp = decode(CompletionResponse, "completion.json")
    assert comp.choices[0].text == " 1, 2, 3, 4" and comp.choices[0].finish_reason == "length"
    stats = spec_stats_from_sglext(comp.sglext)
    assert stats is not None and (stats.verify_ct, stats.accept_length, stats.histogram) == (
        2, 4.0, (0, 0, 0, 2, 0))


def test_sglext_list_for_parallel_sampling_picks_the_choice():
    chat = msgspec.json.decode(
        b'{"id":"c","choices":[],"sglext":{"spec_tokens_details":[{"spec_verify_ct":1,'
        b'"spec_num_correct_drafts":0},{"spec_verify_ct":2,"spec_num_correct_drafts":4}]}}',
        type=ChatCompletionResponse)
    assert spec_stats_from_sglext(chat.sglext, 1).num_correct_drafts == 4
    assert spec_stats_from_sglext(chat.sglext, 2) is None
    assert spec_stats_from_sglext(None) is None


def test_loads_fixtures():
    loads = decode(LoadsResponse, "loads.json")
    assert loads.timestamp == "2026-10-30T12:00:00.123456+00:00" and loads.dp_rank_count == 1
    rank = loads.loads[0]
    assert (rank.num_running_reqs, rank.num_waiting_reqs, rank.num_used_tokens,
            rank.max_total_num_tokens, rank.max_running_requests, rank.token_usage) == (
        3, 1, 5000, 20000, 48, 0.25)
    assert rank.gen_throughput == 112.5
    assert rank.speculative is not None and (rank.speculative.accept_length,
                                             rank.speculative.accept_rate) == (2.4, 0.47)
    dp2 = decode(LoadsResponse, "loads_dp2.json")
    assert [r.token_usage for r in dp2.loads] == [0.1, 0.9]


def test_server_and_model_info_fixtures():
    info = decode(ServerInfo, "server_info.json")
    assert (info.model_path, info.served_model_name, info.revision, info.weight_version) == (
        "meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b",
        "0e9e39f249a16976918f6564b8830bc894c89659", "default")
    assert (info.speculative_algorithm, info.speculative_num_draft_tokens,
            info.speculative_draft_model_path, info.speculative_draft_model_revision) == (
        "EAGLE3", 4, "jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B", None)
    assert (info.max_running_requests, info.max_total_num_tokens, info.version) == (48, 20000, "0.5.23")
    assert info.internal_states[0].avg_spec_accept_length == 2.87
    assert info.specgate_per_request_speculation is False
    # none of specgate's step-cost fields: their defaults (policies.live_costs.from_server_info refuses them)
    assert (info.specgate_step_costs, info.specgate_step_costs_context, info.specgate_draft_token_s,
            info.specgate_round_overhead_s) == ([], None, {}, 0.0)
    model = decode(ModelInfo, "model_info.json")
    assert (model.model_path, model.weight_version, model.is_generation, model.architectures) == (
        "meta-llama/Llama-3.1-8B-Instruct", "default", True, ["LlamaForCausalLM"])


def test_error_shapes():
    native = decode(ErrorEnvelope, "generate_error_400.json").detail_or_none()
    assert native is not None and native.message.startswith("Input length (9000 tokens) exceeds")
    openai = decode(ErrorEnvelope, "openai_error_400.json").detail_or_none()
    assert openai == ErrorDetail(message="max_tokens must be positive", type="BadRequestError",
                                 code=400, object="error")
    assert decode(ErrorEnvelope, "health_503.json").detail_or_none() == ErrorDetail(
        message="Server is not ready")
    assert decode(ErrorEnvelope, "loads.json").detail_or_none() is None


def test_generate_request_encodes_only_what_is_set():
    req = GenerateRequest(text="hi", rid="r1", stream=True, sampling_params=SamplingParams(
        max_new_tokens=8, temperature=0.0,
        custom_params={"speculation": {"proposer": "ngram", "draft_tokens": 4}}))
    assert msgspec.to_builtins(req) == {
        "text": "hi", "rid": "r1", "stream": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0,
                            "custom_params": {"speculation": {"proposer": "ngram", "draft_tokens": 4}}}}
    with pytest.raises(ValueError, match="exactly one of `text` or `input_ids`"):
        GenerateRequest(text="a", input_ids=[1])
    with pytest.raises(ValueError, match="exactly one"):
        GenerateRequest()
    with pytest.raises(msgspec.ValidationError, match="unknown field `temprature`"):
        msgspec.convert({"temprature": 0.5}, SamplingParams)


def test_the_client_reads_every_spec_field_the_embedded_worker_sends():
    """One Struct models both sides: the worker encodes ``MetaInfo`` and the client decodes it (before, the
    worker's spec_proposed_per_position was silently dropped). Every response: tests/worker/test_wire_roundtrip.py."""
    from backends.engine.types import RequestStats
    from backends.sglang.spec_stats import spec_stats_from
    from backends.sglang.wire import MetaInfo
    from backends.worker.responses import spec_fields

    sent = spec_fields(RequestStats(
        completion_tokens=10, verify_ct=4, num_correct_drafts=6, num_proposed_drafts=12,
        correct_drafts_histogram=[1, 1, 0, 2], accepted_per_position=[3, 2, 1], proposed_per_position=[4, 4, 4],
        reached_per_position=[4, 3, 2], draft_s=0.01, verify_s=0.02, first_token_s=0.25, e2e_s=1.0))
    raw = msgspec.json.encode(MetaInfo(id="r", **sent))
    meta = msgspec.json.decode(raw, type=MetaInfo)
    assert {k for k, v in sent.items() if v is not None} <= set(msgspec.json.decode(raw))
    assert msgspec.to_builtins(meta) == msgspec.json.decode(raw)
    stats = spec_stats_from(meta)
    assert stats is not None
    assert (stats.accepted_per_position, stats.proposed_per_position, stats.reached_per_position) == (
        (3, 2, 1), (4, 4, 4), (4, 3, 2))
    assert (stats.verify_ct, stats.num_correct_drafts, stats.num_proposed_drafts, stats.histogram) == (
        4, 6, 12, (1, 1, 0, 2))
    assert (stats.accept_length, stats.accept_rate, stats.draft_s, stats.verify_s) == (2.5, 0.5, 0.01, 0.02)
    assert (meta.specgate_first_token_s, meta.specgate_decode_s) == (0.25, 0.75)


def test_worker_timings_are_optional_and_sglangs_queue_time_is_read():
    """specgate's timing fields are absent from a real SGLang answer (None), and a request that never got a
    first token sends none; SGLang's own ``queue_time`` (--enable-metrics) is read when sent."""
    from backends.engine.types import RequestStats
    from backends.worker.responses import spec_fields

    real = msgspec.json.decode(b'{"id":"r","e2e_latency":0.5,"queue_time":0.01,"prefill_launch_delay":0.002}',
                               type=MetaInfo)
    assert (real.queue_time, real.specgate_first_token_s, real.specgate_decode_s) == (0.01, None, None)
    aborted = spec_fields(RequestStats(e2e_s=0.3))  # aborted before its first token
    assert (aborted["specgate_first_token_s"], aborted["specgate_decode_s"]) == (None, None)


REQUESTS = {"SamplingParams", "SpeculationOverride", "GenerateReqInput", "GenerateRequest", "AbortRequest",
            "StreamOptions", "ResponseFormat", "OpenAIRequestFields", "ChatCompletionRequest", "CompletionRequest"}


def test_sparse_responses_default_only_to_none_or_always():
    """In a response Struct that omits unset fields, a plain default other than None would be omitted or not
    by an accident of identity (msgspec omits a value that IS the default; small ints and short strings are
    shared objects), so such fields are ``= None`` (sent when set) or ``= always(x)`` (always sent)."""
    from backends.sglang import openai_wire, wire

    kinds = [k for module in (wire, openai_wire) for k in vars(module).values()
             if isinstance(k, type) and issubclass(k, msgspec.Struct)
             and k.__module__ == module.__name__ and k.__name__ not in REQUESTS]
    assert {"MetaInfo", "ChatCompletionChunk", "RankLoad", "ErrorDetail", "ModelList"} <= {k.__name__ for k in kinds}
    plain = [f"{kind.__name__}.{field.name} = {field.default!r}"
             for kind in kinds if kind.__struct_config__.omit_defaults
             for field in msgspec.structs.fields(kind)
             if field.default not in (None, msgspec.NODEFAULT)]
    assert plain == []


def test_always_fields_are_sent_null_and_zero_included_and_default_when_read():
    from backends.sglang.wire import MetaInfo

    assert msgspec.json.decode(msgspec.json.encode(MetaInfo(id="r", cached_tokens=0))) == {
        "id": "r", "finish_reason": None, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
        "weight_version": None}
    read = msgspec.json.decode(b'{"id": "r"}', type=MetaInfo)
    assert (read.finish_reason, read.cached_tokens, read.spec_verify_ct) == (None, 0, None)
