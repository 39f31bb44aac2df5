"""The OpenAI request bodies the gateway accepts: strict msgspec Structs (CONTRIBUTING.md #4, #6).

A misspelled or unsupported field is a 400 naming it, never silently dropped. Bodies are decoded
once to a plain dict (what is forwarded to the worker, which applies the chat template) and then
converted to the Struct for validation; both steps cost microseconds. A few SGLang extensions that
the worker honours (``top_k``, ``min_p``, ``repetition_penalty``...) are accepted; ``rid`` and
``custom_params`` are not: the gateway owns them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from gateway.errors import ApiError


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(ge=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
MaxTokens = Annotated[int, Meta(ge=1)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]  # alternatives per token (OpenAI's bound)
Stop = str | Annotated[list[str], Meta(max_length=16)]


class ContentPart(_Strict, kw_only=True):
    type: Literal["text", "image_url", "input_audio", "file"]
    text: str | None = None
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None


class Message(_Strict, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    function_call: dict[str, Any] | None = None


class FunctionDef(_Strict, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class ResponseFormat(_Strict, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StreamOptions(_Strict, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool | None = None


class _Common(_Strict, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: Stop | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang extensions the worker honours
    top_k: int | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0, le=2)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None


class ChatRequest(_Common, kw_only=True):
    messages: list[Message]
    max_completion_tokens: MaxTokens | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[str | int]  # text, token ids, or a one-element list of text
    echo: bool = False
    suffix: str | None = None
    logprobs: TopLogprobs | None = None
    best_of: int | None = None

    @property
    def budget(self) -> int | None:
        return self.max_tokens


_RAW = msgspec.json.Decoder()


def field_of(text: str) -> str | None:
    """``... - at `$.messages[0].role``` -> ``messages[0].role``; an unknown key names itself."""
    if "unknown field `" in text:
        name = text.split("unknown field `", 1)[1].split("`", 1)[0]
        where = text.rsplit(" - at `$", 1)[1].rstrip("`").lstrip(".") if " - at `$" in text else ""
        return f"{where}.{name}" if where else name
    if " - at `$" in text:
        return text.rsplit(" - at `$", 1)[1].rstrip("`").lstrip(".") or None
    return None


def parse_body(raw: bytes, kind: type[ChatRequest] | type[CompletionRequest]
               ) -> tuple[dict[str, Any], ChatRequest | CompletionRequest]:
    """(the body as a dict to forward, the validated Struct), or an ``ApiError`` 400."""
    try:
        body = _RAW.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON ({exc}); send a JSON object",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}",
                       code="invalid_json")
    try:
        request = msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = field_of(text)
        hint = "; remove it" if "unknown field" in text else ""
        raise ApiError(400, f"invalid field `{param}`: {text.split(' - at ')[0]}{hint}" if param
                       else f"invalid request: {text}", param=param, code="invalid_field") from None
    _check(request)
    return body, request


def _check(request: ChatRequest | CompletionRequest) -> None:
    """Checks a Struct bound cannot say well: non-empty input, n == 1, top_logprobs only with logprobs."""
    if request.n != 1:
        raise ApiError(400, f"n must be 1 (one choice per request), got {request.n}", param="n")
    if isinstance(request, ChatRequest):
        if not request.messages:
            raise ApiError(400, "messages is empty; send at least one message", param="messages")
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true; set it or remove top_logprobs",
                           param="top_logprobs")
        if request.max_tokens is not None and request.max_completion_tokens is not None \
                and request.max_tokens != request.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens disagree; send one of them",
                           param="max_completion_tokens")
    elif not request.prompt or request.prompt == [""] or request.prompt == "":
        raise ApiError(400, "prompt is empty; send a non-empty prompt", param="prompt")
    elif isinstance(request.prompt, list) and any(isinstance(p, str) for p in request.prompt):
        if len(request.prompt) > 1:
            raise ApiError(400, "batched prompts are not supported; send one prompt (a string or a "
                           "list of token ids) per request", param="prompt")
