"""SGLang's HTTP protocol, one msgspec Struct per message, for both sides (CONTRIBUTING.md #6): /generate, /abort_request,
errors, /v1/loads, /server_info, /model_info, /v1/models, and what the OpenAI-compatible endpoints share with
them (``always``, ``SpecFields``); their own messages are in ``openai_wire.py``; the rules below hold for both.

The client (``client.py``) encodes the requests and decodes the responses with these Structs; specgate's
embedded worker (``backends/worker/``) decodes the same requests and builds and encodes the same responses.
A field exists once, so nothing the worker sends can be silently dropped by the client
(``tests/worker/test_wire_roundtrip.py`` decodes every response the worker produces and checks it).

Requests. Defaults are SGLang's own, and a field left at its default is not sent (``omit_defaults``: an
omitted field and its default mean the same to the server). ``sampling_params`` is closed as in SGLang
(unknown key: an error; ``custom_params`` is the only free-form place); top-level keys are open, as SGLang
ignores unknown ones (smg adds ``model``, ``return_bytes``...). Value checks (SGLang's
``SamplingParams.verify``: bounds, exactly one prompt, messages naming the field) are the server's: the
worker does them in ``backends/worker/translate.py``, where they become 400s naming the field. Only the
client's own construction check lives here, in the ``GenerateRequest`` subclass: the worker must not run it
while decoding (it answers with SGLang's messages and ``param``), and it adds no field.

Responses are tolerant: unknown keys are ignored and optional fields default, because SGLang renames and
adds fields across releases (every ``spec_*`` field is optional). What goes on the wire is decided per
field, so the worker's bytes stay what SGLang clients expect:
- a Struct whose fields are always all sent uses plain defaults (null is sent as null);
- a Struct with ``omit_defaults=True`` sends a field declared ``= None`` only when set, and a field declared
  ``= always(x)`` every time (``x`` is only what a reader gets when a body lacks it). Plain defaults other
  than None are not used there: msgspec omits a value that IS its default, which for ints and strings is
  an accident of interning (a test checks the rule).

Field names and shapes were checked against SGLang's source (``tests/fixtures/sglang/README.md`` names the
function each shape comes from): ``/generate``: ``srt/managers/io_struct.py::GenerateReqInput``,
``srt/sampling/sampling_params.py``, ``tokenizer_manager.py::_handle_batch_output`` (spec fields:
``_calculate_spec_decoding_metrics``, 0.5.x ``spec_decoding_meta.py``); OpenAI endpoints:
``srt/entrypoints/openai/protocol.py``; ``/v1/loads``: ``srt/entrypoints/v1_loads.py::get_loads``;
``/server_info``, ``/model_info``: ``srt/entrypoints/http_server.py``.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UnsetType

from speculation import SpeculationOverride  # noqa: F401 - custom_params.speculation, defined with the vocabulary


def always(default: Any) -> Any:
    """The default of a field that is always sent, in a Struct whose ``= None`` fields are sent only when set.

    msgspec has no per-field switch (jcrist/msgspec#633): it omits a value that is the field's default, but
    a factory's default only when the factory is ``list``, ``dict``... and the value an empty one. So a field
    with a factory of its own is always encoded, null included, and a body without it decodes to ``default``."""
    if isinstance(default, list):
        return msgspec.field(default_factory=lambda: list(default))
    return msgspec.field(default_factory=lambda: default)


# --------------------------------------------------------------------------------------------------
# Requests


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True,
                     omit_defaults=True):
    """``sampling_params`` (SGLang ``srt/sampling/sampling_params.py``), with SGLang's defaults.

    ``max_new_tokens: None`` (sent as null) means "up to the context window"; left out, SGLang's 128.
    ``custom_params`` is the only free-form place SGLang allows; specgate puts its per-request speculation
    override there (``custom_params.speculation``: ``speculation.SpeculationOverride``).
    """

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    temperature: float = 1.0  # < 1e-6 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    custom_params: dict[str, Any] | None = None


class GenerateReqInput(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Body of ``POST /generate`` as a server reads it (SGLang ``io_struct.py::GenerateReqInput``): exactly
    one of ``text`` / ``input_ids`` / ``input_embeds`` (checked by the server); unknown keys ignored.

    ``logprob_start_len``: -1 = logprobs of output tokens only, else of the prompt too from that position.
    """

    text: str | None = None
    input_ids: list[int] | None = None
    input_embeds: Any = None
    sampling_params: SamplingParams = SamplingParams()
    rid: str | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    priority: int | None = None
    custom_labels: dict[str, str] | None = None
    routing_key: str | None = None
    log_metrics: bool | None = None


class GenerateRequest(GenerateReqInput, frozen=True, kw_only=True, omit_defaults=True):
    """A ``/generate`` body the client builds: the same fields, checked when built so a malformed request
    never leaves (a server answers it with its own 400)."""

    def __post_init__(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("GenerateRequest needs exactly one of `text` or `input_ids`")


class AbortRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """``POST /abort_request``: stop the request ``rid`` (or every request)."""

    rid: str = ""
    abort_all: bool = False


# --------------------------------------------------------------------------------------------------
# /generate responses


class FinishReason(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
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
    carry the same ones (``spec_stats.py`` normalises them). The embedded worker sends the 0.5.x names and
    its extras, never the aliases. The worker's request timings (``specgate_*``) are fields here, not of
    ``MetaInfo`` alone, because the OpenAI endpoints the gateway relays have no ``meta_info``: they reach
    it in ``sglext.spec_tokens_details`` (of the whole answer, or of a stream's final ``sglext`` chunk)."""

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
    spec_chosen_per_k: list[int] | None = None  # rounds per draft length asked for (a per-round controller's picks)
    spec_draft_s: float | None = None
    spec_verify_s: float | None = None
    # specgate's embedded worker: the engine's own clock, seconds, final chunk only. SGLang's meta_info has
    # no such durations (with --enable-metrics it adds wall-clock timestamps, ``prefill_finished_ts``,
    # ``decode_finished_ts``, and a ``decode_throughput``, taken in its tokenizer manager and defined
    # differently across releases), so the names are specgate's and only this worker sends them.
    specgate_first_token_s: float | None = None  # engine intake -> first committed token (queue + prefill + round 1)
    specgate_decode_s: float | None = None  # first committed token -> finished (TPOT = this / (completion_tokens - 1))
    # plain decoding's estimated time for this answer over its rounds' (RequestStats.plain_ratio; auto learns from it)
    specgate_plain_ratio: float | None = None
    # seconds its drafts added to the other sequences' steps (RequestStats.neighbour_s; auto charges them)
    specgate_neighbour_s: float | None = None


LogprobEntry = tuple[float | None, int, str | None]
"""SGLang's ``[logprob, token_id, text]``; text is null unless ``return_text_in_logprobs``."""


class MetaInfo(SpecFields, frozen=True, kw_only=True, omit_defaults=True):
    """``meta_info`` of a /generate response (spec_* fields: ``SpecFields``, final chunk only).

    Logprobs (``return_logprob``): one entry per output token, with ``top_logprobs_num`` > 0 its
    alternatives; ``input_*``: the prompt's from ``logprob_start_len`` (the first prompt token has none).
    """

    id: str
    finish_reason: FinishReason | None = always(None)  # null until the final chunk
    prompt_tokens: int = always(0)
    completion_tokens: int = always(0)
    cached_tokens: int = always(0)
    weight_version: str | None = always(None)
    e2e_latency: float | None = None
    queue_time: float | None = None  # seconds waiting before the first forward (SGLang's name, --enable-metrics)
    num_retractions: int | None = None
    reasoning_tokens: int | None = None
    output_token_logprobs: list[LogprobEntry] | None = None
    output_top_logprobs: list[list[LogprobEntry] | None] | None = None
    input_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None


class GenerateResponse(msgspec.Struct, frozen=True, kw_only=True):
    """One /generate body, or one streaming chunk. ``text`` is absent with ``skip_tokenizer_init``."""

    text: str | None = None
    output_ids: list[int] = []
    meta_info: MetaInfo


# --------------------------------------------------------------------------------------------------
# Errors


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Inner object of ``{"error": {...}}``: OpenAI's ``{message, type, param, code}``; SGLang's mid-stream
    error chunk is ``{message, type, code, retryable}`` (its sender leaves ``param`` UNSET: not sent)."""

    message: str = always("")
    type: str | None = None
    param: str | None | UnsetType = always(None)
    code: int | str | None = None
    retryable: bool | None = None
    object: str | None = None


class ErrorEnvelope(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
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


# --------------------------------------------------------------------------------------------------
# Load and identity


class SpeculativeLoad(msgspec.Struct, frozen=True, kw_only=True):
    accept_length: float | None = None
    accept_rate: float | None = None


class RankLoad(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One data-parallel rank of ``/v1/loads``."""

    dp_rank: int = always(0)
    num_running_reqs: int = always(0)
    num_waiting_reqs: int = always(0)
    num_total_reqs: int | None = None
    num_used_tokens: int = always(0)
    max_total_num_tokens: int | None = None
    max_running_requests: int | None = None
    token_usage: float = always(0.0)
    gen_throughput: float | None = None
    cache_hit_rate: float | None = None
    utilization: float | None = None
    speculative: SpeculativeLoad | None = None
    memory: dict[str, Any] | None = None


class LoadsResponse(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """``GET /v1/loads``. ``timestamp`` is an ISO string (smg breaks on an integer)."""

    timestamp: str | None = None
    version: str | None = None
    dp_rank_count: int | None = None
    loads: list[RankLoad] = always([])
    aggregate: dict[str, Any] | None = None


class InternalState(msgspec.Struct, frozen=True, kw_only=True):
    avg_spec_accept_length: float | None = None


class ServerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /server_info``: the server args specgate reads or its worker reports (a real SGLang server
    sends every server arg; the others are ignored)."""

    model_path: str | None = None
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    revision: str | None = None
    weight_version: str | None = None
    dtype: str | None = None
    context_length: int | None = None
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_adaptive: bool | None = None
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
    max_queued_requests: int | None = None
    max_total_num_tokens: int | None = None
    chunked_prefill_size: int | None = None
    version: str | None = None
    # specgate's embedded worker only (step costs: [sequences, tokens, seconds] per forward as its rule prices it,
    # the measurements fitted non-decreasing in tokens, docs/engine.md;
    # with the draft seconds per token by proposer, the per-round overhead and the context the start-up
    # calibration measured the table at, None without one: a replay cost model, policies/costmodel.py)
    specgate_max_batch_tokens: int | None = None
    specgate_step_costs: list[tuple[int, int, float]] = []
    specgate_step_costs_context: int | None = None
    specgate_draft_token_s: dict[str, float] = {}
    specgate_round_overhead_s: float = 0.0
    specgate_per_request_speculation: bool = False
    specgate_draft_layers: int | None = None
    specgate_tokenizer_digest: str | None = None  # backends.engine.model_store.tokenizer_digest
    specgate_fault_injection: bool = False  # the test-only --fault-injection switch (backends/engine/faults.py)
    specgate_fault_mode: str = "off"  # off, lossy_accept or random_draft
    internal_states: list[InternalState] = []


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /model_info`` (``http_server.py::model_info``)."""

    model_path: str | None = None
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    weight_version: str | None = None
    is_generation: bool | None = None
    preferred_sampling_params: dict[str, Any] | None = None
    has_image_understanding: bool | None = None
    has_audio_understanding: bool | None = None
    model_type: str | None = None
    architectures: list[str] | None = None


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of ``GET /v1/models`` (``protocol.py::ModelCard``); owned_by "sglang" marks SGLang for smg."""

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "sglang"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct, frozen=True, kw_only=True):  # GET /v1/models
    object: str = "list"
    data: list[ModelCard] = []


class AbortResponse(msgspec.Struct, frozen=True, kw_only=True):  # the worker's /abort_request (SGLang: no body)
    aborted: bool

