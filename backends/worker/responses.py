"""Response bodies in SGLang's shapes: /generate meta_info and the OpenAI objects with ``sglext``.

The spec_* numbers come from the engine's ``RequestStats`` (counters); rates are derived here with the
formulas SGLang uses (``tokenizer_manager.py::_calculate_spec_decoding_metrics``):
spec_accept_length = completion_tokens / spec_verify_ct (the bonus/recovered token included),
spec_accept_rate = spec_num_correct_drafts / spec_num_proposed_drafts.
Spec fields are reported for every request (a plain request has accept_length 1.0 and no drafts), so a
gateway can compare proposers on the same fields.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from backends.engine.types import RequestOutput, RequestStats, TokenLogprob
from backends.sglang.wire import WorkerSpecFields
from backends.worker.logprobs import TokenTexts, chat_logprobs, completion_logprobs, sglang_meta


def spec_fields(stats: RequestStats) -> dict[str, Any]:
    """SGLang's spec_* meta_info fields plus specgate's per-position counters and timings, as the one
    ``WorkerSpecFields`` Struct the client side reads them with (``backends/sglang/wire.py``)."""
    return msgspec.structs.asdict(WorkerSpecFields(
        spec_verify_ct=stats.verify_ct, spec_accept_length=stats.accept_length,
        spec_accept_rate=stats.num_correct_drafts / stats.num_proposed_drafts if stats.num_proposed_drafts else 0.0,
        spec_num_correct_drafts=stats.num_correct_drafts, spec_num_proposed_drafts=stats.num_proposed_drafts,
        spec_correct_drafts_histogram=list(stats.correct_drafts_histogram),
        spec_accepted_per_position=list(stats.accepted_per_position),
        spec_proposed_per_position=list(stats.proposed_per_position),
        spec_reached_per_position=list(stats.reached_per_position),
        spec_draft_s=stats.draft_s, spec_verify_s=stats.verify_s))


def spec_tokens_details(stats: RequestStats) -> dict[str, Any]:
    """``sglext.spec_tokens_details`` (SGLang ``openai/utils.py::spec_tokens_details_from_meta_info``)."""
    spec = spec_fields(stats)
    return {
        "spec_accept_rate": spec["spec_accept_rate"],
        "spec_accept_length": spec["spec_accept_length"],
        "spec_cap_length": 0.0,
        "spec_block_accept_length": 0.0,
        "spec_num_correct_drafts": spec["spec_num_correct_drafts"],
        "spec_num_proposed_drafts": spec["spec_num_proposed_drafts"],
        "spec_verify_ct": spec["spec_verify_ct"],
        "spec_correct_drafts_histogram": spec["spec_correct_drafts_histogram"],
        "spec_cap_lens_histogram": [],
        **{k: v for k, v in spec.items() if k not in _SGLANG_DETAIL_KEYS},
    }


_SGLANG_DETAIL_KEYS = frozenset({"spec_accept_rate", "spec_accept_length", "spec_num_correct_drafts",
                                 "spec_num_proposed_drafts", "spec_verify_ct", "spec_correct_drafts_histogram"})


def meta_info(out: RequestOutput, prompt_tokens: int, weight_version: str, logprobs: int | None = None,
              texts: TokenTexts | None = None, prompt_from: int | None = None) -> dict[str, Any]:
    """``logprobs``: the request's alternatives per token (None: not asked); ``texts``: name each token
    in them (``return_text_in_logprobs``); ``prompt_from``: the prompt's too, from this position."""
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finish_reason.to_dict() if out.finish_reason else None,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": 0,
        "weight_version": weight_version,
    }
    if logprobs is not None:
        meta.update(sglang_meta(out.logprobs, logprobs, texts))
        if prompt_from is not None and out.prompt_logprobs:
            meta.update(sglang_meta(out.prompt_logprobs[prompt_from:], logprobs, texts, side="input"))
    if out.finished:
        meta["e2e_latency"] = out.stats.e2e_s
        meta.update(spec_fields(out.stats))
    return meta


def generate_body(out: RequestOutput, prompt_tokens: int, weight_version: str, logprobs: int | None = None,
                  texts: TokenTexts | None = None, prompt_from: int | None = None) -> dict[str, Any]:
    """One /generate object (the whole response, or one cumulative stream chunk)."""
    return {"text": out.text, "output_ids": list(out.output_ids),
            "meta_info": meta_info(out, prompt_tokens, weight_version, logprobs, texts, prompt_from)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finish(out: RequestOutput) -> tuple[str | None, Any]:
    if out.finish_reason is None:
        return None, None
    return out.finish_reason.type, out.finish_reason.matched


class OpenAIShaper:
    """Builds chat.completion / text_completion objects and stream chunks for one request."""

    def __init__(self, *, chat: bool, rid: str, model: str, prompt_tokens: int, weight_version: str,
                 spec_details: bool, logprobs: int | None = None, texts: TokenTexts | None = None,
                 echo: str = "") -> None:
        self.chat = chat
        self.rid = rid
        self.model = model
        self.prompt_tokens = prompt_tokens
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

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """The choice's ``logprobs`` for these tokens (None when not asked for)."""
        if self.logprobs is None or self.texts is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.texts)
        body = completion_logprobs(entries, self.texts, self.logprobs, self.sent_chars)
        if entries:
            self.sent_chars = body["text_offset"][-1] + len(body["tokens"][-1])
        return body

    def _envelope(self, chunk: bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def response(self, out: RequestOutput) -> dict[str, Any]:
        reason, matched = _finish(out)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": out.text, "reasoning_content": None,
                                 "tool_calls": None}
        else:
            choice["text"] = self.echo + out.text
        entries = (*(out.prompt_logprobs if self.echo else ()), *out.logprobs)
        choice.update({"logprobs": self._logprobs(entries), "finish_reason": reason, "matched_stop": matched})
        body = self._envelope(False, [choice])
        body["usage"] = usage(self.prompt_tokens, len(out.output_ids))
        body["metadata"] = {"weight_version": self.weight_version}
        if self.spec_details:
            body["sglext"] = {"spec_tokens_details": spec_tokens_details(out.stats)}
        return body

    def first_chunk(self, out: RequestOutput | None = None) -> dict[str, Any] | None:
        """Chat streams open with the assistant role (OpenAI's first chunk); completions only with the
        echoed prompt (with its logprobs: ``out`` is the first event, see :attr:`echo_waits`)."""
        if not self.chat:
            if not self.echo:
                return None
            scored = self._logprobs(out.prompt_logprobs) if out is not None else None
            return self._envelope(True, [{"index": 0, "text": self.echo, "logprobs": scored, "finish_reason": None,
                                          "matched_stop": None}])
        return self._envelope(True, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None, "matched_stop": None}])

    def chunk(self, out: RequestOutput) -> dict[str, Any] | None:
        """The text added since the last chunk; None when nothing new and not finished."""
        text = out.text
        delta = text[len(self.sent_text):] if text.startswith(self.sent_text) else text
        self.sent_text = text
        if not delta and not out.finished:
            return None
        reason, matched = _finish(out)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": delta} if delta else {}
        else:
            choice["text"] = delta
        new = out.logprobs[self.sent_logprobs:]
        self.sent_logprobs = len(out.logprobs)
        choice.update({"logprobs": self._logprobs(new), "finish_reason": reason, "matched_stop": matched})
        return self._envelope(True, [choice])

    def tail_chunks(self, out: RequestOutput, include_usage: bool) -> list[dict[str, Any]]:
        """After the finishing chunk: the ``sglext`` chunk, then the usage chunk (SGLang's order)."""
        tail = []
        if self.spec_details:
            chunk = self._envelope(True, [])
            chunk["sglext"] = {"spec_tokens_details": spec_tokens_details(out.stats)}
            tail.append(chunk)
        if include_usage:
            chunk = self._envelope(True, [])
            chunk["usage"] = usage(self.prompt_tokens, len(out.output_ids))
            tail.append(chunk)
        return tail
