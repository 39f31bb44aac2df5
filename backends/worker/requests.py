"""Request bodies the worker accepts, validated like SGLang validates them.

Strict where SGLang is strict, tolerant where it is tolerant (STYLE.md #6):
- top-level keys of every body are open (smg and OpenAI SDKs add keys such as ``model``,
  ``return_text_in_logprobs``, ``log_metrics``, ``echo``, ``logprobs``; SGLang ignores them);
- ``sampling_params`` is closed: an unknown key is a 400 naming it, as in SGLang, except inside
  ``custom_params`` (free-form);
- ``custom_params.speculation`` is ours and closed (``SpeculationOverride``).
Value checks SGLang performs in ``SamplingParams.verify`` live in ``translate.py``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from backends.engine.types import MAX_DRAFT_TOKENS, Proposer

StopField = str | list[str] | None


class SamplingParamsBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``sampling_params`` of ``POST /generate`` (SGLang ``srt/sampling/sampling_params.py``)."""

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    stop: StopField = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
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


class GenerateBody(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /generate``: exactly one of ``text`` / ``input_ids``; unknown top-level keys ignored."""

    text: str | None = None
    input_ids: list[int] | None = None
    input_embeds: Any = None
    sampling_params: SamplingParamsBody = SamplingParamsBody()
    rid: str | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # -1: output tokens only (prompt logprobs are not computed)
    return_text_in_logprobs: bool = False


class SpeculationOverride(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``custom_params.speculation``: per-request speculation (specgate's extension).

    Any field left out keeps the worker's launch default. A real SGLang server ignores the whole object.
    ``scope`` (suffix decoding): whose earlier outputs the suffix proposer may draft from; the gateway sends
    the route's name. Its length (at most ``SCOPE_MAX_CHARS``) is checked in ``translate.speculation`` so
    the message can say what to do. The n-gram and suffix settings are server settings (launch flags, part
    of the pair version), never per request.
    """

    proposer: Proposer | None = None
    draft_tokens: Annotated[int, Meta(ge=1, le=MAX_DRAFT_TOKENS)] | None = None
    adaptive: bool | None = None
    scope: str | None = None


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True):
    """``response_format``: only its type matters here (the schema of json_schema is never read)."""

    type: str


class _OpenAIFields(msgspec.Struct, frozen=True, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions, incl. SGLang's extensions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: StopField = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    rid: str | None = None
    custom_params: dict[str, Any] | None = None
    return_spec_tokens_details: bool = False
    user: str | None = None


class ChatCompletionBody(_OpenAIFields, frozen=True, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionBody(_OpenAIFields, frozen=True, kw_only=True):
    prompt: str | list[int | str]  # one prompt: text, token ids, or a one-element list of text
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


class AbortBody(msgspec.Struct, frozen=True, kw_only=True):
    rid: str = ""
    abort_all: bool = False
