"""SGLang / OpenAI request bodies -> the engine's ``GenerateRequest``.

Value checks follow SGLang's ``SamplingParams.verify`` (same bounds, messages naming the field). Fields
SGLang accepts but the embedded engine does not implement (constrained decoding: regex, json_schema,
``response_format`` other than text; a forced ``tool_choice``; logit_bias; n > 1; the completion's
fill-in-the-middle ``suffix``) are refused with a 400 that says so, rather than silently ignored. Both
OpenAI endpoints are turned into SGLang's ``sampling_params`` first, so every path goes through the same checks.
The bodies are the wire Structs the client sends (``backends/sglang/wire.py``); their checks live here, where
a refusal becomes a 400 naming the field.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from backends.engine.types import (
    MAX_DRAFT_TOKENS, MAX_TOP_LOGPROBS, PROPOSERS, SCOPE_MAX_CHARS, GenerateRequest, SamplingParams,
    SpeculationParams,
)
from speculation import SpeculationOverride
from backends.sglang import wire
from backends.sglang import openai_wire
from backends.worker.errors import BadRequest

_UNSUPPORTED = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "logit_bias")
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class Limits:
    """What a request is checked against: the model's window and the worker's launch speculation."""

    context_length: int
    default_speculation: SpeculationParams


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise BadRequest(f"{field} {message}", field)


def sampling_params(body: wire.SamplingParams, prompt_len: int, limits: Limits, where: str) -> SamplingParams:
    """Validate like SGLang and convert; ``where`` prefixes field names in messages."""
    for name in _UNSUPPORTED:
        _check(getattr(body, name) is None, f"{where}{name}",
               "is not supported by the specgate embedded engine; remove it")
    _check(body.n == 1, f"{where}n", f"must be 1 on the specgate embedded engine, got {body.n}")
    room = limits.context_length - prompt_len
    max_new = room if body.max_new_tokens is None else body.max_new_tokens
    _check(max_new >= 1, f"{where}max_new_tokens", f"must be at least 1, got {max_new}")
    _check(0 <= body.min_new_tokens <= max_new, f"{where}min_new_tokens",
           f"must be in [0, max_new_tokens={max_new}], got {body.min_new_tokens}")
    _check(body.temperature >= 0, f"{where}temperature", f"must be non-negative, got {body.temperature}")
    _check(0 < body.top_p <= 1, f"{where}top_p", f"must be in (0, 1], got {body.top_p}")
    _check(0 <= body.min_p <= 1, f"{where}min_p", f"must be in [0, 1], got {body.min_p}")
    _check(body.top_k >= -1, f"{where}top_k", f"must be -1 (disable), 0 (disable) or at least 1, got {body.top_k}")
    _check(-2 <= body.frequency_penalty <= 2, f"{where}frequency_penalty",
           f"must be in [-2, 2], got {body.frequency_penalty}")
    _check(-2 <= body.presence_penalty <= 2, f"{where}presence_penalty",
           f"must be in [-2, 2], got {body.presence_penalty}")
    _check(0 < body.repetition_penalty <= 2, f"{where}repetition_penalty",
           f"must be in (0, 2], got {body.repetition_penalty}")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(
        max_new_tokens=max_new, min_new_tokens=body.min_new_tokens, temperature=body.temperature,
        top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty, repetition_penalty=body.repetition_penalty,
        stop=stop, stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
        no_stop_trim=body.no_stop_trim, skip_special_tokens=body.skip_special_tokens,
        sampling_seed=body.sampling_seed,
    )


# what custom_params.speculation takes, quoted in every message about it
SPECULATION_SHAPE = (f"{{proposer: {'|'.join(PROPOSERS)}, draft_tokens: 1..{MAX_DRAFT_TOKENS}, adaptive: bool, "
                     "strategy: beta|sglang|vllm, k_by_batch: [[lowest batch size, k], ...], "
                     f"prior: up to {MAX_DRAFT_TOKENS} rates in [0, 1], "
                     f"scope: string of at most {SCOPE_MAX_CHARS} characters}}")


def speculation(custom_params: dict[str, Any] | None, default: SpeculationParams, where: str) -> SpeculationParams:
    """``custom_params.speculation`` merged over the worker's launch default (absent: the default).

    Only proposer, draft_tokens, adaptive (with strategy, k_by_batch and prior) and scope are per request;
    the n-gram settings (``ngram_*``) always come from the launch default: they are server settings, part of
    the pair version."""
    raw = (custom_params or {}).get("speculation")
    if raw is None:
        return default
    field = f"{where}custom_params.speculation"
    try:
        override = msgspec.convert(raw, SpeculationOverride)
    except msgspec.ValidationError as exc:
        text = str(exc)
        path = text.rsplit(" - at `$", 1)[1].rstrip("`") if " - at `$" in text else ""
        raise BadRequest(f"invalid {field}{path}: {text.split(' - at ')[0]}; expected {SPECULATION_SHAPE}",
                         f"{field}{path}") from exc
    problem = override.problem()
    if problem is not None:
        raise BadRequest(f"{field}.{problem[0]} {problem[1]}", f"{field}.{problem[0]}")
    table = default.k_by_batch if override.k_by_batch is None else tuple(map(tuple, override.k_by_batch))
    strategy = override.strategy or default.strategy
    _check(strategy != "vllm" or table, f"{field}.k_by_batch",
           "strategy vllm needs k_by_batch (vLLM's num_speculative_tokens_per_batch_size), e.g. [[1, 8], [4, 4]]")
    proposer = override.proposer or default.proposer
    adaptive = default.adaptive if override.adaptive is None else override.adaptive
    _check(proposer != "hybrid" or not adaptive or strategy == "beta", f"{field}.strategy",
           f"proposer hybrid picks its source and k with strategy beta, got {strategy}; send strategy beta "
           "or another proposer")
    return replace(
        default,
        proposer=proposer,
        draft_tokens=override.draft_tokens or default.draft_tokens,
        adaptive=adaptive,
        strategy=strategy, k_by_batch=table,
        prior=default.prior if override.prior is None else tuple(override.prior),
        scope=default.scope if override.scope is None else override.scope,
    )


def _logprobs(count: int | None, field: str) -> int | None:
    """The number of alternatives per token (None: no logprobs), checked against the engine's bound."""
    _check(count is None or 0 <= count <= MAX_TOP_LOGPROBS, field,
           f"must be in [0, {MAX_TOP_LOGPROBS}], got {count}")
    return count


def _rid(rid: str | None) -> str:
    if rid is not None and not rid:
        raise BadRequest("rid must be a non-empty string when given", "rid")
    return rid or uuid.uuid4().hex


def generate_request(body: wire.GenerateReqInput, tokenizer: Any, limits: Limits) -> GenerateRequest:
    if body.input_embeds is not None:
        raise BadRequest("input_embeds is not supported by the specgate embedded engine; send text or "
                         "input_ids", "input_embeds")
    if body.text is not None and body.input_ids is not None:
        raise BadRequest("Only one of text and input_ids should be provided, not both", "text")
    if body.text is None and body.input_ids is None:
        raise BadRequest("Either text or input_ids should be provided", "text")
    if body.text is not None:
        if not body.text:
            raise BadRequest("text is empty; send a non-empty prompt", "text")
        input_ids = tokenizer.encode(body.text, add_special_tokens=False)
    else:
        input_ids = body.input_ids
        if not input_ids:
            raise BadRequest("input_ids is empty; send at least one token id", "input_ids")
    logprobs = None
    if body.return_logprob:
        _check(-1 <= body.logprob_start_len < len(input_ids), "logprob_start_len", f"must be -1 (output tokens "
               f"only) or a prompt position in [0, {len(input_ids)}), got {body.logprob_start_len}")
        logprobs = _logprobs(body.top_logprobs_num, "top_logprobs_num")
    return _request(input_ids, body.sampling_params, body.rid, limits, "sampling_params.", logprobs,
                    prompt_logprobs=logprobs is not None and body.logprob_start_len >= 0)


def _request(input_ids: list[int], params: wire.SamplingParams, rid: str | None, limits: Limits,
             where: str, logprobs: int | None = None, prompt_logprobs: bool = False) -> GenerateRequest:
    if len(input_ids) >= limits.context_length:
        raise BadRequest(f"the prompt has {len(input_ids)} tokens but the model's context window is "
                         f"{limits.context_length}; shorten the prompt", "text")
    return GenerateRequest(
        rid=_rid(rid), input_ids=tuple(input_ids),
        sampling=sampling_params(params, len(input_ids), limits, where),
        speculation=speculation(params.custom_params, limits.default_speculation, where),
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
    )


def _openai_sampling(body: openai_wire.OpenAIRequestFields, max_tokens: int | None) -> wire.SamplingParams:
    """OpenAI names -> SGLang's sampling_params (SGLang's ``to_sampling_params`` mapping)."""
    try:
        return wire.SamplingParams(
            max_new_tokens=max_tokens, min_new_tokens=body.min_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k, min_p=body.min_p or 0.0,
            frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            stop=body.stop, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
            no_stop_trim=body.no_stop_trim, skip_special_tokens=body.skip_special_tokens,
            n=body.n, logit_bias=body.logit_bias, sampling_seed=body.seed, custom_params=body.custom_params,
        )
    except TypeError as exc:  # pragma: no cover - every field is typed by the body already
        raise BadRequest(str(exc)) from exc


def completion_request(body: openai_wire.CompletionRequest, tokenizer: Any, limits: Limits) -> GenerateRequest:
    _check(not body.suffix, "suffix", "(fill-in-the-middle) is not supported by the specgate embedded engine; "
           "remove it")
    _check(body.best_of in (None, 1), "best_of", f"must be 1 on the specgate embedded engine, got {body.best_of}")
    prompt = body.prompt
    if isinstance(prompt, list) and any(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise BadRequest("batched prompts are not supported; send one prompt (a string or a list "
                             "of token ids) per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty; send a non-empty prompt", "prompt")
        input_ids = tokenizer.encode(prompt, add_special_tokens=False)
    else:
        if not prompt:
            raise BadRequest("prompt is empty; send a non-empty prompt", "prompt")
        input_ids = list(prompt)
    logprobs = _logprobs(body.logprobs, "logprobs")
    return _request(input_ids, _openai_sampling(body, body.max_tokens), body.rid, limits, "", logprobs,
                    prompt_logprobs=body.echo and logprobs is not None)


def echo_text(body: openai_wire.CompletionRequest, request: GenerateRequest, tokenizer: Any) -> str:
    """What ``echo: true`` puts before the completion: the prompt as sent (token ids decoded)."""
    if not body.echo:
        return ""
    prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
    return prompt if isinstance(prompt, str) else tokenizer.decode(list(request.input_ids))


def _message_text(index: int, message: dict[str, Any]) -> dict[str, str]:
    role = message.get("role")
    if role not in _ROLES:
        raise BadRequest(f"messages[{index}].role must be one of {', '.join(_ROLES)}, got {role!r}",
                         f"messages[{index}].role")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{index}].content: only text parts are supported "
                                 "({\"type\": \"text\", \"text\": ...})", f"messages[{index}].content")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None and message.get("tool_calls"):
        content = json.dumps(message["tool_calls"])
    if not isinstance(content, str):
        raise BadRequest(f"messages[{index}].content must be a string or a list of text parts",
                         f"messages[{index}].content")
    return {"role": "system" if role == "developer" else role, "content": content}


def chat_prompt(body: openai_wire.ChatCompletionRequest, tokenizer: Any) -> list[int]:
    """Render ``messages`` with the model's chat template.

    Tools: the model has no tool parser. If its template renders ``tools`` they are passed to it;
    otherwise (SmolLM2's template) they are described in a system message ahead of the conversation,
    so the model sees them; tool calls are never parsed out of the answer.
    """
    if not body.messages:
        raise BadRequest("messages is empty; send at least one message", "messages")
    messages = [_message_text(i, m) for i, m in enumerate(body.messages)]
    kwargs = dict(body.chat_template_kwargs or {})
    if body.tools:
        if "tools" in (tokenizer.chat_template or ""):
            kwargs["tools"] = body.tools
        else:
            listing = json.dumps(body.tools, separators=(",", ":"))
            messages.insert(0, {"role": "system", "content": f"You can call these tools (JSON): {listing}"})
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as exc:  # a template error is the client's input, not a worker failure
        raise BadRequest(f"messages could not be rendered with the model's chat template: {exc}",
                         "messages") from exc
    return tokenizer.encode(text, add_special_tokens=False)


def _check_unforced(body: openai_wire.ChatCompletionRequest) -> None:
    """Refuse what the engine would have to force (constrained decoding, a required tool call) rather than
    answer free text the client did not ask for; SGLang servers with a grammar backend do these."""
    kind = body.response_format.type if body.response_format is not None else None
    _check(kind in (None, "text"), "response_format", f"{kind!r} needs constrained decoding, which the specgate "
           "embedded engine does not implement; remove it or send the request to an SGLang worker")
    _check(body.tool_choice in (None, "auto", "none"), "tool_choice", f"{body.tool_choice!r} would force a tool "
           "call, which the specgate embedded engine cannot (it does not parse or constrain tool calls); send "
           "'auto' or 'none', or remove it")


def chat_request(body: openai_wire.ChatCompletionRequest, tokenizer: Any, limits: Limits) -> GenerateRequest:
    _check_unforced(body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    _check(body.top_logprobs is None or body.logprobs, "top_logprobs", "needs logprobs: true; set it or "
           "remove top_logprobs")
    logprobs = _logprobs(body.top_logprobs or 0, "top_logprobs") if body.logprobs else None
    return _request(chat_prompt(body, tokenizer), _openai_sampling(body, max_tokens), body.rid, limits, "",
                    logprobs)
