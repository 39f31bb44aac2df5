"""Every wire type of SGLang's HTTP protocol that specgate sends or reads, in one module (STYLE.md #6).

Requests we send are strict and omit unset fields (a real SGLang server rejects unknown keys inside
``sampling_params``, so we never send keys it would not know). Responses we read are tolerant:
unknown keys are ignored and every ``spec_*`` field is optional, because SGLang renamed them across
releases. Field names and shapes were checked against SGLang's source (see
``tests/fixtures/sglang/README.md`` for the function each shape comes from):

- ``/generate``: ``srt/entrypoints/http_server.py::generate_request`` returns the dict built in
  ``srt/managers/tokenizer_manager.py::_handle_batch_output`` (``text``, ``output_ids``, ``meta_info``);
  spec fields come from ``_calculate_spec_decoding_metrics`` (0.5.x: ``spec_decoding_meta.py``).
- OpenAI endpoints: ``srt/entrypoints/openai/protocol.py`` (``ChatCompletionResponse``,
  ``CompletionResponse``, their stream variants, ``SglExt``, ``UsageInfo``, ``ErrorResponse``).
- ``/v1/loads``: ``srt/entrypoints/v1_loads.py::get_loads``.
"""

from __future__ import annotations

from typing import Any

import msgspec

# --------------------------------------------------------------------------------------------------
# Requests (what we own: strict, unset fields omitted)


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True,
                     omit_defaults=True):
    """SGLang ``sampling_params`` (``srt/sampling/sampling_params.py``). ``None`` = server default.

    ``custom_params`` is the only free-form place SGLang allows; specgate puts its per-request
    speculation override there (``custom_params.speculation = {proposer, draft_tokens}``).
    """

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool | None = None
    no_stop_trim: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    skip_special_tokens: bool | None = None
    custom_params: dict[str, Any] | None = None


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True,
                      omit_defaults=True):
    """Body of ``POST /generate`` (``io_struct.py::GenerateReqInput``): exactly one of text/input_ids."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = SamplingParams()
    rid: str | None = None
    stream: bool = False
    return_logprob: bool | None = None
    top_logprobs_num: int | None = None
    priority: int | None = None
    custom_labels: dict[str, str] | None = None
    routing_key: str | None = None
    log_metrics: bool | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("GenerateRequest needs exactly one of `text` or `input_ids`")


# --------------------------------------------------------------------------------------------------
# Responses (what we read: tolerant)


class FinishReason(msgspec.Struct, frozen=True, kw_only=True):
    """``{"type":"stop","matched":...}`` | ``{"type":"length","length":N}`` |
    ``{"type":"abort","message":...,"status_code":...}`` (``schedule_batch.py::FINISH_*.to_json``)."""

    type: str
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None


class SpecFields(msgspec.Struct, frozen=True, kw_only=True):
    """Every spec_* name any release used, all optional; ``meta_info`` and ``sglext.spec_tokens_details``
    carry the same ones (``spec_stats.py`` normalises them)."""

    # 0.5.x names
    spec_verify_ct: int | None = None
    spec_accept_length: float | None = None
    spec_accept_rate: float | None = None
    spec_num_correct_drafts: int | None = None
    spec_num_proposed_drafts: int | None = None
    spec_correct_drafts_histogram: list[int] | None = None
    # transitional aliases (emitted beside the 0.5.x names, "remove in next release")
    spec_accepted_drafts: int | None = None
    spec_proposed_drafts: int | None = None
    spec_accept_histogram: list[int] | None = None
    # older releases (<= 0.4.x)
    spec_accept_token_num: int | None = None
    spec_draft_token_num: int | None = None
    # specgate's embedded worker extras (a real SGLang server never sends these)
    spec_accepted_per_position: list[int] | None = None
    spec_proposed_per_position: list[int] | None = None
    spec_reached_per_position: list[int] | None = None
    spec_draft_s: float | None = None
    spec_verify_s: float | None = None


class WorkerSpecFields(msgspec.Struct, frozen=True, kw_only=True):
    """What specgate's embedded worker sends (``backends/worker/responses.py`` encodes exactly this, in
    ``meta_info`` and ``sglext.spec_tokens_details``): SGLang 0.5.x's names plus specgate's per-position
    counters and timings. Declared here, beside the client's ``SpecFields``, so one module models both
    sides; a test checks that ``SpecFields`` reads every field of it (none is silently dropped)."""

    spec_verify_ct: int
    spec_accept_length: float
    spec_accept_rate: float
    spec_num_correct_drafts: int
    spec_num_proposed_drafts: int
    spec_correct_drafts_histogram: list[int]
    spec_accepted_per_position: list[int]
    spec_proposed_per_position: list[int]
    spec_reached_per_position: list[int]
    spec_draft_s: float
    spec_verify_s: float


class MetaInfo(SpecFields, frozen=True, kw_only=True):
    """``meta_info`` of a /generate response (spec_* fields: ``SpecFields``)."""

    id: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | None = None
    e2e_latency: float | None = None
    num_retractions: int | None = None
    reasoning_tokens: int | None = None


class GenerateResponse(msgspec.Struct, frozen=True, kw_only=True):
    """One /generate body, or one streaming chunk. ``text`` is absent with ``skip_tokenizer_init``."""

    meta_info: MetaInfo
    text: str | None = None
    output_ids: list[int] = []


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True):
    """Inner object of ``{"error": {...}}`` (native errors; also OpenAI stream error chunks)."""

    message: str = ""
    type: str | None = None
    code: int | str | None = None
    param: str | None = None
    retryable: bool | None = None
    object: str | None = None


class ErrorEnvelope(msgspec.Struct, frozen=True, kw_only=True):
    """Either ``{"error": {...}}`` or OpenAI's flat ``{"object": "error", "message", "type", "code"}``."""

    error: ErrorDetail | str | None = None
    object: str | None = None
    message: str | None = None
    type: str | None = None
    code: int | str | None = None
    detail: Any = None  # FastAPI's HTTPException body

    def detail_or_none(self) -> ErrorDetail | None:
        """The error, whichever of SGLang's shapes carried it; None when the body is not an error."""
        if isinstance(self.error, ErrorDetail):
            return self.error
        if isinstance(self.error, str):
            return ErrorDetail(message=self.error)
        if self.object == "error" or self.message is not None:
            return ErrorDetail(message=self.message or "", type=self.type, code=self.code,
                               object=self.object)
        if self.detail is not None:
            return ErrorDetail(message=self.detail if isinstance(self.detail, str) else str(self.detail))
        return None


class SpecTokensDetails(SpecFields, frozen=True, kw_only=True):
    """``sglext.spec_tokens_details`` (``openai/utils.py::spec_tokens_details_from_meta_info``)."""

    spec_cap_length: float | None = None
    spec_block_accept_length: float | None = None
    spec_cap_lens_histogram: list[int] | None = None


class SglExt(msgspec.Struct, frozen=True, kw_only=True):
    """Top-level ``sglext`` of OpenAI responses. With ``n > 1`` spec details are one per choice."""

    spec_tokens_details: SpecTokensDetails | list[SpecTokensDetails] | None = None
    cached_tokens_details: dict[str, Any] | None = None
    routed_experts: str | None = None


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    reasoning_tokens: int | None = None
    prompt_tokens_details: dict[str, Any] | None = None


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    message: ChatMessage = ChatMessage()
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    model: str = ""
    object: str = "chat.completion"
    created: int = 0
    choices: list[ChatChoice] = []
    usage: Usage | None = None
    sglext: SglExt | None = None
    metadata: dict[str, Any] | None = None


class ChatStreamChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    delta: ChatMessage = ChatMessage()
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One ``chat.completion.chunk``. The last two SGLang sends have ``choices == []``: the
    ``sglext`` chunk (when ``return_spec_tokens_details``) and then the ``usage`` chunk."""

    id: str
    model: str = ""
    object: str = "chat.completion.chunk"
    created: int = 0
    choices: list[ChatStreamChoice] = []
    usage: Usage | None = None
    sglext: SglExt | None = None


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    """A /v1/completions choice; in streaming chunks ``text`` is the delta."""

    index: int = 0
    text: str = ""
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(msgspec.Struct, frozen=True, kw_only=True):
    """``text_completion`` body, and (same shape) each streaming chunk of /v1/completions."""

    id: str
    model: str = ""
    object: str = "text_completion"
    created: int = 0
    choices: list[CompletionChoice] = []
    usage: Usage | None = None
    sglext: SglExt | None = None
    metadata: dict[str, Any] | None = None


class SpeculativeLoad(msgspec.Struct, frozen=True, kw_only=True):
    accept_length: float | None = None
    accept_rate: float | None = None


class RankLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One data-parallel rank of ``/v1/loads``."""

    dp_rank: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_total_reqs: int | None = None
    num_used_tokens: int = 0
    max_total_num_tokens: int | None = None
    max_running_requests: int | None = None
    token_usage: float = 0.0
    gen_throughput: float | None = None
    cache_hit_rate: float | None = None
    utilization: float | None = None
    speculative: SpeculativeLoad | None = None
    memory: dict[str, Any] | None = None


class LoadsResponse(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /v1/loads``. ``timestamp`` is an ISO string (smg breaks on an integer)."""

    loads: list[RankLoad] = []
    timestamp: str | None = None
    version: str | None = None
    dp_rank_count: int | None = None
    aggregate: dict[str, Any] | None = None


class InternalState(msgspec.Struct, frozen=True, kw_only=True):
    avg_spec_accept_length: float | None = None


class ServerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of ``GET /server_info`` that specgate reads (it carries all server args)."""

    model_path: str | None = None
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    revision: str | None = None
    weight_version: str | None = None
    context_length: int | None = None
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_draft_model_path: str | None = None
    speculative_draft_model_revision: str | None = None
    # n-gram lookup: SGLang's NGRAM args (both report the window sizes); the match rule is specgate's
    speculative_ngram_min_match_window_size: int | None = None
    speculative_ngram_max_match_window_size: int | None = None
    speculative_ngram_match: str | None = None
    # suffix decoding: specgate's embedded worker only (SGLang has no SUFFIX algorithm)
    speculative_suffix_max_tree_depth: int | None = None
    speculative_suffix_max_cached_requests: int | None = None
    speculative_suffix_max_spec_factor: float | None = None
    speculative_suffix_min_token_prob: float | None = None
    speculative_suffix_max_scopes: int | None = None
    max_running_requests: int | None = None
    max_total_num_tokens: int | None = None
    version: str | None = None
    internal_states: list[InternalState] = []
    specgate_per_request_speculation: bool = False


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /model_info`` (``http_server.py::model_info``)."""

    model_path: str | None = None
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    weight_version: str | None = None
    is_generation: bool | None = None
    model_type: str | None = None
    architectures: list[str] | None = None

