"""Response bodies as SGLang's wire Structs (``backends/sglang/wire.py``, the ones the client decodes):
/generate's ``meta_info`` and the OpenAI objects with ``sglext``.

The spec_* numbers come from the engine's ``RequestStats`` (counters); rates are derived here with the
formulas SGLang uses (``tokenizer_manager.py::_calculate_spec_decoding_metrics``):
spec_accept_length = completion_tokens / spec_verify_ct (the bonus/recovered token included),
spec_accept_rate = spec_num_correct_drafts / spec_num_proposed_drafts.
Spec fields are reported for every request (a plain request has accept_length 1.0 and no drafts), so a
gateway can compare proposers on the same fields.

Timings, on the final chunk beside them, from the engine's clock (``RequestStats``): ``queue_time`` (SGLang's
meta_info name: waiting before the first forward; /generate only), ``specgate_first_token_s`` (intake to the
first committed token) and ``specgate_decode_s`` (first committed token to the end), the last two also in
``sglext.spec_tokens_details``, so the gateway has a TPOT for a whole (non-streamed) answer too.

Token ids, when asked for, where SGLang 0.5.23 puts them (``backends/sglang/token_ids.py``): chat in the
response-level ``sglext`` (``input_ids``, ``output_ids`` per choice; streamed, in the sglext chunk), completions
per choice (``prompt_token_ids`` on the first chunk a stream sends, ``token_ids`` with the ids each chunk adds).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from backends.engine.types import RequestOutput, RequestStats, TokenLogprob
from backends.sglang import wire
from backends.sglang import openai_wire
from backends.worker.logprobs import TokenTexts, chat_logprobs, completion_logprobs, sglang_meta


def spec_fields(stats: RequestStats) -> dict[str, Any]:
    """SGLang 0.5.x's spec_* fields plus specgate's per-position counters and timings, as keyword arguments
    of ``wire.MetaInfo`` and ``openai_wire.SpecTokensDetails`` (both carry ``wire.SpecFields``)."""
    return msgspec.structs.asdict(wire.SpecFields(
        spec_verify_ct=stats.verify_ct, spec_accept_length=stats.accept_length,
        spec_accept_rate=stats.num_correct_drafts / stats.num_proposed_drafts if stats.num_proposed_drafts else 0.0,
        spec_num_correct_drafts=stats.num_correct_drafts, spec_num_proposed_drafts=stats.num_proposed_drafts,
        spec_correct_drafts_histogram=list(stats.correct_drafts_histogram),
        spec_accepted_per_position=list(stats.accepted_per_position),
        spec_proposed_per_position=list(stats.proposed_per_position),
        spec_reached_per_position=list(stats.reached_per_position),
        spec_chosen_per_k=list(stats.chosen_per_k),
        spec_draft_s=stats.draft_s, spec_verify_s=stats.verify_s, specgate_plain_ratio=stats.plain_ratio,
        specgate_neighbour_s=stats.neighbour_s,
        **timing_fields(stats)))


def timing_fields(stats: RequestStats) -> dict[str, float]:
    """``specgate_first_token_s`` and ``specgate_decode_s`` of a finished request; none before its first
    token (aborted while waiting or in prefill)."""
    first, e2e = stats.first_token_s, stats.e2e_s
    if first is None or e2e is None:
        return {}
    return {"specgate_first_token_s": first, "specgate_decode_s": max(0.0, e2e - first)}


def spec_tokens_details(stats: RequestStats) -> openai_wire.SpecTokensDetails:
    """``sglext.spec_tokens_details`` (SGLang ``openai/utils.py::spec_tokens_details_from_meta_info``); the
    capped-length fields are SGLang's for tree drafts, which the embedded engine never builds."""
    return openai_wire.SpecTokensDetails(**spec_fields(stats), spec_cap_length=0.0, spec_block_accept_length=0.0,
                                  spec_cap_lens_histogram=[])


def finish_reason(out: RequestOutput) -> wire.FinishReason | None:
    reason = out.finish_reason
    if reason is None:
        return None
    return wire.FinishReason(type=reason.type, matched=reason.matched, length=reason.length,
                             message=reason.message, status_code=reason.status_code)


def meta_info(out: RequestOutput, prompt_tokens: int, weight_version: str, logprobs: int | None = None,
              texts: TokenTexts | None = None, prompt_from: int | None = None) -> wire.MetaInfo:
    """``logprobs``: the request's alternatives per token (None: not asked); ``texts``: name each token
    in them (``return_text_in_logprobs``); ``prompt_from``: the prompt's too, from this position."""
    extra: dict[str, Any] = {}
    if logprobs is not None:
        extra.update(sglang_meta(out.logprobs, logprobs, texts))
        if prompt_from is not None and out.prompt_logprobs:
            extra.update(sglang_meta(out.prompt_logprobs[prompt_from:], logprobs, texts, side="input"))
    if out.finished:
        stats = out.stats
        extra.update(e2e_latency=stats.e2e_s, **spec_fields(stats))
        if stats.first_token_s is not None or stats.queue_s:  # 0.0: never admitted
            extra["queue_time"] = stats.queue_s
    return wire.MetaInfo(id=out.rid, finish_reason=finish_reason(out), prompt_tokens=prompt_tokens,
                         completion_tokens=len(out.output_ids), cached_tokens=0, weight_version=weight_version,
                         **extra)


def generate_body(out: RequestOutput, prompt_tokens: int, weight_version: str, logprobs: int | None = None,
                  texts: TokenTexts | None = None, prompt_from: int | None = None) -> wire.GenerateResponse:
    """One /generate object (the whole response, or one cumulative stream chunk)."""
    return wire.GenerateResponse(text=out.text, output_ids=list(out.output_ids),
                                 meta_info=meta_info(out, prompt_tokens, weight_version, logprobs, texts, prompt_from))


def usage(prompt_tokens: int, completion_tokens: int) -> openai_wire.Usage:
    return openai_wire.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)


def _finish(out: RequestOutput) -> tuple[str | None, Any]:
    if out.finish_reason is None:
        return None, None
    return out.finish_reason.type, out.finish_reason.matched


Body = openai_wire.ChatCompletionResponse | openai_wire.ChatCompletionChunk | openai_wire.CompletionResponse


class OpenAIShaper:
    """Builds chat.completion / text_completion objects and stream chunks for one request. ``prompt_ids``
    and the ``*_ids`` flags: the token ids asked for (module docstring)."""

    def __init__(self, *, chat: bool, rid: str, model: str, prompt_tokens: int, weight_version: str,
                 spec_details: bool, logprobs: int | None = None, texts: TokenTexts | None = None,
                 echo: str = "", prompt_ids: Sequence[int] = (), input_ids: bool = False,
                 output_ids: bool = False, skip_special_tokens: bool = True) -> None:
        self.chat = chat
        self.skip_special_tokens = skip_special_tokens  # the request's: whether special tokens are in its text
        self.rid = rid
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.prompt_ids = list(prompt_ids)
        self.input_ids = input_ids  # chat: sglext.input_ids; completions: choices[].prompt_token_ids
        self.output_ids = output_ids  # chat: sglext.output_ids; completions: choices[].token_ids
        self.sent_ids = 0  # a stream: output ids already sent
        self.released_bytes = 0  # bytes of the ids counted in sent_ids (``_released``)
        self.prompt_ids_sent = False
        self.weight_version = weight_version
        self.spec_details = spec_details
        self.created = int(time.time())
        self.sent_text = ""
        self.echo = echo  # completions' echo: the prompt text ahead of the completion
        self.logprobs = logprobs  # alternatives per token; None: logprobs not asked for
        self.texts = texts
        self.sent_logprobs = 0  # tokens whose logprobs a stream chunk carried
        self.sent_chars = 0  # completions' text_offset of the next token

    @property
    def echo_waits(self) -> bool:
        """A completions stream echoing with logprobs sends its first chunk once the prompt is scored."""
        return not self.chat and bool(self.echo) and self.logprobs is not None

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> Any:
        """The choice's ``logprobs`` for these tokens (None when not asked for)."""
        if self.logprobs is None or self.texts is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.texts)
        body = completion_logprobs(entries, self.texts, self.logprobs, self.sent_chars)
        if entries:
            self.sent_chars = body.text_offset[-1] + len(body.tokens[-1])
        return body

    def _choice(self, text: str, entries: Sequence[TokenLogprob], out: RequestOutput | None, *,
                chunk: bool) -> Any:
        """One choice: ``text`` is the message (chat), the delta (chat chunk) or the text (completions)."""
        reason, matched = _finish(out) if out is not None else (None, None)
        logprobs = self._logprobs(entries)
        if not self.chat:
            return openai_wire.CompletionChoice(text=text, logprobs=logprobs, finish_reason=reason, matched_stop=matched,
                                         **self._choice_ids(out, chunk))
        if not chunk:
            return openai_wire.ChatChoice(message=openai_wire.ChatMessage(role="assistant", content=text), logprobs=logprobs,
                                   finish_reason=reason, matched_stop=matched)
        return openai_wire.ChatStreamChoice(delta=openai_wire.DeltaMessage(content=text or None), logprobs=logprobs,
                                     finish_reason=reason, matched_stop=matched, **self._choice_ids(out, chunk))

    def _choice_ids(self, out: RequestOutput | None, chunk: bool) -> dict[str, Any]:
        """The ids for the next choice sent: the prompt's once, then the output ids not sent yet (completions;
        chat streams too, see ``openai_wire.ChatStreamChoice``). A stream sends an id only once its text was
        (``_released``), so the ids a client has seen always spell the text it has seen."""
        ids: dict[str, Any] = {}
        if self.chat and not chunk:
            return ids
        if self.input_ids and not self.prompt_ids_sent:
            ids["prompt_token_ids"], self.prompt_ids_sent = self.prompt_ids, True
        if self.output_ids and out is not None:
            upto = self._released(out) if chunk else len(out.output_ids)
            ids["token_ids"], self.sent_ids = list(out.output_ids[self.sent_ids:upto]), max(self.sent_ids, upto)
        return ids

    def _released(self, out: RequestOutput) -> int:
        """How many output ids the streamed text covers: all once finished; before, the ids whose bytes fit in
        the text sent (the engine holds back a possible stop-string prefix and an incomplete UTF-8
        character, whose ids are then sent with the text that completes them). Byte-level BPE decodes to
        the concatenation of its tokens' bytes; incremental, so a stream costs O(tokens)."""
        if out.finished or self.texts is None:
            return len(out.output_ids)
        budget = len(out.text.encode())
        released, used = self.sent_ids, self.released_bytes
        for token in out.output_ids[released:]:
            size = self.texts.streamed_bytes(token, self.skip_special_tokens)
            if used + size > budget:
                break
            used += size
            released += 1
        self.released_bytes = used
        return released

    def _sglext(self, out: RequestOutput) -> openai_wire.SglExt | None:
        """Chat's response-level extension: speculation details and the ids asked for (None: nothing asked)."""
        ids = self.chat and (self.input_ids or self.output_ids)
        if not self.spec_details and not ids:
            return None
        return openai_wire.SglExt(
            spec_tokens_details=spec_tokens_details(out.stats) if self.spec_details else None,
            input_ids=self.prompt_ids if self.chat and self.input_ids else None,
            output_ids=[list(out.output_ids)] if self.chat and self.output_ids else None)

    def _chunk(self, choices: list[Any], **fields: Any) -> Body:
        kind = openai_wire.ChatCompletionChunk if self.chat else openai_wire.CompletionResponse
        return kind(id=self.rid, created=self.created, model=self.model, choices=choices, **fields)

    def response(self, out: RequestOutput) -> Body:
        entries = (*(out.prompt_logprobs if self.echo else ()), *out.logprobs)
        kind = openai_wire.ChatCompletionResponse if self.chat else openai_wire.CompletionResponse
        return kind(id=self.rid, created=self.created, model=self.model,
                    choices=[self._choice(self.echo + out.text, entries, out, chunk=False)],
                    usage=usage(self.prompt_tokens, len(out.output_ids)),
                    metadata={"weight_version": self.weight_version}, sglext=self._sglext(out))

    def first_chunk(self, out: RequestOutput | None = None) -> Body | None:
        """Chat streams open with the assistant role (OpenAI's first chunk); completions only with the
        echoed prompt (with its logprobs: ``out`` is the first event, see :attr:`echo_waits`)."""
        if not self.chat:
            if not self.echo:
                return None
            return self._chunk([self._choice(self.echo, out.prompt_logprobs if out is not None else (), None,
                                             chunk=True)])
        prompt = {"prompt_token_ids": self.prompt_ids} if self.input_ids else {}
        self.prompt_ids_sent = bool(prompt)
        return self._chunk([openai_wire.ChatStreamChoice(delta=openai_wire.DeltaMessage(role="assistant", content=""),
                                                         **prompt)])

    def chunk(self, out: RequestOutput) -> Body | None:
        """The text added since the last chunk; None when nothing new and not finished."""
        text = out.text
        delta = text[len(self.sent_text):] if text.startswith(self.sent_text) else text
        self.sent_text = text
        if not delta and not out.finished:
            return None
        new = out.logprobs[self.sent_logprobs:]
        self.sent_logprobs = len(out.logprobs)
        return self._chunk([self._choice(delta, new, out, chunk=True)])

    def tail_chunks(self, out: RequestOutput, include_usage: bool) -> list[Body]:
        """After the finishing chunk: the ``sglext`` chunk, then the usage chunk (SGLang's order)."""
        tail = []
        if (sglext := self._sglext(out)) is not None:
            tail.append(self._chunk([], sglext=sglext))
        if include_usage:
            tail.append(self._chunk([], usage=usage(self.prompt_tokens, len(out.output_ids))))
        return tail
