"""Logprobs in SGLang's and OpenAI's shapes (``backends/sglang/wire.py``: ``MetaInfo``'s entries,
``ChatLogprobs``, ``CompletionLogprobs``), from the engine's ``TokenLogprob`` (one per output id).

- ``/generate`` (SGLang ``meta_info``): ``output_token_logprobs`` = ``[[logprob, token_id, text], ...]``
  and, with ``top_logprobs_num`` > 0, ``output_top_logprobs`` = one such list per token; ``text`` is None
  unless ``return_text_in_logprobs``. With ``logprob_start_len`` >= 0 the same for the prompt from that
  position on (``input_token_logprobs``, ``input_top_logprobs``; the first prompt token's logprob is None).
- chat: ``choices[].logprobs.content`` = ``[{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}]``; completions: ``{tokens, token_logprobs, top_logprobs: [{token: logprob}] | None,
  text_offset}``, with ``echo`` the prompt's tokens first (the first one's logprob and alternatives None).

A token's bytes come from its byte-level BPE string mapped back through the GPT-2 byte alphabet, so a
token holding part of a multi-byte character has its true bytes; its text is those bytes decoded, with
``\\xNN`` escapes where they are not whole UTF-8 characters (as OpenAI shows them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backends.engine.types import TokenLogprob
from backends.sglang import wire


from backends.sglang import openai_wire
class TokenTexts:
    """Token id -> (bytes, text), cached per id (a worker sees a small part of the vocabulary)."""

    def __init__(self, tokenizer: Any) -> None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # about 1.1 s: responses.py loads without it

        self._tokenizer = tokenizer
        self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        self._cache: dict[int, tuple[bytes, str]] = {}
        self._specials = frozenset(getattr(tokenizer, "all_special_ids", None) or ())

    def get(self, token_id: int) -> tuple[bytes, str]:
        hit = self._cache.get(token_id)
        if hit is None:
            piece = self._tokenizer.convert_ids_to_tokens(token_id) or ""
            raw = (bytes(self._byte_of[c] for c in piece) if all(c in self._byte_of for c in piece)
                   else piece.encode())  # not byte-level (a special token spelt outside the alphabet)
            hit = self._cache[token_id] = (raw, raw.decode("utf-8", errors="backslashreplace"))
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[1]

    def streamed_bytes(self, token_id: int, skip_special_tokens: bool) -> int:
        """How many bytes ``token_id`` adds to a decoded text (a special token adds none when skipped)."""
        if skip_special_tokens and token_id in self._specials:
            return 0
        return len(self.get(token_id)[0])


def sglang_meta(logprobs: Sequence[TokenLogprob], top: int, texts: TokenTexts | None,
                side: str = "output") -> dict[str, Any]:
    """``wire.MetaInfo`` fields of one ``side`` (output, or input: the prompt's), as keyword arguments;
    ``texts`` None leaves each entry's text None (``return_text_in_logprobs``)."""

    def entry(logprob: float | None, token_id: int) -> wire.LogprobEntry:
        return (logprob, token_id, texts.text(token_id) if texts is not None else None)

    meta: dict[str, Any] = {f"{side}_token_logprobs": [entry(lp.logprob, lp.token_id) for lp in logprobs]}
    if top:
        meta[f"{side}_top_logprobs"] = [None if lp.logprob is None else [entry(v, t) for t, v in lp.top]
                                        for lp in logprobs]
    return meta


def chat_logprobs(logprobs: Sequence[TokenLogprob], texts: TokenTexts) -> openai_wire.ChatLogprobs:
    def top(token_id: int, logprob: float) -> openai_wire.TopLogprob:
        raw, text = texts.get(token_id)
        return openai_wire.TopLogprob(token=text, logprob=logprob, bytes=list(raw))

    def token(lp: TokenLogprob) -> openai_wire.TokenLogprob:
        raw, text = texts.get(lp.token_id)
        return openai_wire.TokenLogprob(token=text, logprob=lp.logprob, bytes=list(raw),
                                 top_logprobs=[top(t, v) for t, v in lp.top])

    return openai_wire.ChatLogprobs(content=[token(lp) for lp in logprobs])


def completion_logprobs(logprobs: Sequence[TokenLogprob], texts: TokenTexts, top: int,
                        offset: int) -> openai_wire.CompletionLogprobs:
    """``offset``: characters of text before the first of these tokens (earlier stream chunks)."""
    tokens = [texts.text(lp.token_id) for lp in logprobs]
    starts = []
    for token in tokens:
        starts.append(offset)
        offset += len(token)
    return openai_wire.CompletionLogprobs(
        tokens=tokens, token_logprobs=[lp.logprob for lp in logprobs],
        top_logprobs=[None if lp.logprob is None else {texts.text(t): v for t, v in lp.top}
                      for lp in logprobs] if top else None,
        text_offset=starts)
