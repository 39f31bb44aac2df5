"""SGLang's OpenAI-compatible generation endpoints, ``/v1/chat/completions`` and ``/v1/completions``, one
msgspec Struct per message, for both sides: requests with SGLang's extensions, responses, stream chunks,
choices, deltas, usage, logprobs and ``sglext`` (spec details, token ids).

The same protocol as ``wire.py`` and the same rules (its docstring: requests open at the top level, responses
tolerant, ``= None`` vs ``always(x)`` in Structs that omit defaults); this family is kept apart because it has
its own SGLang source (``srt/entrypoints/openai/protocol.py``) and is as large as all the rest together. It
builds on ``wire.py``'s ``always`` and ``SpecFields`` (``SpecTokensDetails`` carries the same spec_* fields as
/generate's ``meta_info``); errors (``ErrorEnvelope``) and ``/v1/models`` are in ``wire.py``.

Token ids (SGLang 0.5.23, whose ``--return-input-ids`` / ``--return-output-ids`` switches came with them): chat
asks with ``return_input_ids_in_sglext`` / ``return_output_ids_in_sglext`` and gets ``sglext.input_ids`` and
``sglext.output_ids`` (one list per choice), in the body or, streamed, in the ``choices: []`` sglext chunk
(sgl-project/sglang#34488; its older ``return_token_ids`` is refused on streamed chat); /v1/completions asks
with ``return_token_ids`` and gets ``choices[].prompt_token_ids`` (a stream's first chunk) and
``choices[].token_ids`` (a stream chunk's new ids) (sgl-project/sglang#30917). ``backends/sglang/token_ids.py``
reads and strips them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from backends.sglang.wire import SpecFields, always


# --------------------------------------------------------------------------------------------------
# Requests


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True):
    """``response_format``: only its type is modelled (a json_schema's schema is not read)."""

    type: str


class OpenAIRequestFields(msgspec.Struct, frozen=True, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions (``protocol.py``), incl. SGLang's
    extensions (``top_k``, ``min_p``, ``custom_params``, ``return_spec_tokens_details``...). The gateway
    forwards these bodies as it received them; the worker decodes them with these Structs."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
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


class ChatCompletionRequest(OpenAIRequestFields, frozen=True, kw_only=True):
    messages: list[dict[str, Any]]
    return_input_ids_in_sglext: bool = False  # prompt ids in sglext.input_ids
    return_output_ids_in_sglext: bool = False  # output ids in sglext.output_ids
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(OpenAIRequestFields, frozen=True, kw_only=True):
    prompt: str | list[int | str]  # one prompt: text, token ids, or a one-element list of text
    return_token_ids: bool = False  # choices[].prompt_token_ids and choices[].token_ids
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


# --------------------------------------------------------------------------------------------------
# Responses


class SpecTokensDetails(SpecFields, frozen=True, kw_only=True, omit_defaults=True):
    """``sglext.spec_tokens_details`` (``openai/utils.py::spec_tokens_details_from_meta_info``)."""

    spec_cap_length: float | None = None
    spec_block_accept_length: float | None = None
    spec_cap_lens_histogram: list[int] | None = None


class SglExt(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Top-level ``sglext`` of OpenAI responses. With ``n > 1`` spec details are one per choice."""

    spec_tokens_details: SpecTokensDetails | list[SpecTokensDetails] | None = None
    cached_tokens_details: dict[str, Any] | None = None
    routed_experts: str | None = None
    input_ids: list[int] | None = None  # the prompt's ids (chat, return_input_ids_in_sglext)
    output_ids: list[list[int]] | None = None  # per choice (chat, return_output_ids_in_sglext)


class Usage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    prompt_tokens: int = always(0)
    completion_tokens: int = always(0)
    total_tokens: int = always(0)
    reasoning_tokens: int | None = None
    prompt_tokens_details: dict[str, Any] | None = None


class TopLogprob(msgspec.Struct, frozen=True, kw_only=True):
    """One alternative of a chat token (``protocol.py::TopLogprob``); ``bytes``: the token's exact bytes.
    A logprob of -inf goes on the wire as null."""

    token: str = ""
    logprob: float | None = None
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob, frozen=True, kw_only=True):
    """One chat token with its alternatives (``protocol.py::ChatCompletionTokenLogprob``)."""

    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    """``choices[].logprobs`` of chat (``protocol.py::ChoiceLogprobs``)."""

    content: list[TokenLogprob] | None = None


class CompletionLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    """``choices[].logprobs`` of /v1/completions (``protocol.py::LogProbs``): one entry per token;
    ``top_logprobs`` maps each alternative's text to its logprob (null without ``logprobs`` > 0)."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float | None] | None] | None = None
    text_offset: list[int] = []


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    """``choices[].message`` of a chat response (every field sent, null included)."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class DeltaMessage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """``choices[].delta`` of a chat stream chunk: only what this chunk adds (``{}`` on the finishing one)."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    message: ChatMessage = ChatMessage()
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    id: str
    object: str = always("chat.completion")
    created: int = always(0)
    model: str = always("")
    choices: list[ChatChoice] = always([])
    usage: Usage | None = None
    metadata: dict[str, Any] | None = None
    sglext: SglExt | None = None


class ChatStreamChoice(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A chat stream chunk's choice. ``token_ids`` / ``prompt_token_ids``: specgate's embedded worker only, on
    a stream that asked for ``return_output_ids_in_sglext`` / ``return_input_ids_in_sglext`` (the chunk's new
    ids; the prompt's on the first chunk), as completions choices carry them: what lets the gateway resume a
    chat stream mid-answer (``gateway/resume.py``). SGLang sends chat ids only in the final sglext chunk."""

    index: int = always(0)
    delta: DeltaMessage = always(DeltaMessage())
    logprobs: ChatLogprobs | None = always(None)
    finish_reason: str | None = always(None)
    matched_stop: int | str | None = always(None)
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One ``chat.completion.chunk``. The last two SGLang sends have ``choices == []``: the
    ``sglext`` chunk (when ``return_spec_tokens_details``) and then the ``usage`` chunk."""

    id: str
    object: str = always("chat.completion.chunk")
    created: int = always(0)
    model: str = always("")
    choices: list[ChatStreamChoice] = always([])
    usage: Usage | None = None
    sglext: SglExt | None = None


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A /v1/completions choice; in streaming chunks ``text`` is the delta. The token ids are sent only when
    asked for (``return_token_ids``); in a stream, ``token_ids`` are the chunk's new ones."""

    index: int = always(0)
    text: str = always("")
    logprobs: CompletionLogprobs | None = always(None)
    finish_reason: str | None = always(None)
    matched_stop: int | str | None = always(None)
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """``text_completion`` body, and (same shape) each streaming chunk of /v1/completions."""

    id: str
    object: str = always("text_completion")
    created: int = always(0)
    model: str = always("")
    choices: list[CompletionChoice] = always([])
    usage: Usage | None = None
    metadata: dict[str, Any] | None = None
    sglext: SglExt | None = None
