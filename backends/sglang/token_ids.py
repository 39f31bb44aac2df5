"""SGLang's token-id extensions of the OpenAI endpoints: asking a worker for a request's prompt and output
token ids, reading them from its answer, and taking them out of that answer again.

The gateway asks only for the requests it records (``gateway/tracing.py``) and the streams it may resume on
another worker (``gateway/resume.py``: specgate's embedded worker also puts a chat stream's ids on each chunk's
choice, as completions choices carry them), and always strips the ids from
what its client receives: they are a gateway-internal side channel (clients cannot ask for them; the
gateway's strict request parsing refuses the fields). The names are SGLang 0.5.23's (``backends/sglang/wire.py``
models them; the deploy kit's image, whose ``--return-input-ids`` / ``--return-output-ids`` switches came with
the chat fields):

- ``/v1/chat/completions``: ``return_input_ids_in_sglext`` and ``return_output_ids_in_sglext`` (sgl-project/
  sglang#34488). The answer's response-level ``sglext`` carries ``input_ids`` (the prompt as the server
  tokenized it, chat template included) and ``output_ids`` (one list per choice), in the body, or streamed in
  the one ``choices: []`` sglext chunk before the usage chunk. The older per-choice ``return_token_ids`` /
  ``return_prompt_token_ids`` are refused on a streamed chat (400), so they are not used.
- ``/v1/completions``: ``return_token_ids`` (sgl-project/sglang#30917): ``choices[].prompt_token_ids`` (in
  the body, or a stream's first chunk) and ``choices[].token_ids`` (all of them, or each stream chunk's new
  ones, concatenated here).

vLLM spells its field ``return_token_ids`` on both endpoints with the prompt's ids at the top level
(``prompt_token_ids``) and ``token_ids`` per choice; only its completions answers match what is read here. A
worker that does not know these fields (an SGLang before them, vLLM's chat) ignores them and answers without
ids: such requests are not recorded, and the recorder counts them (``no_ids``).
"""

from __future__ import annotations

from typing import Any

import msgspec

_CHAT_FIELDS = {"return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}
_COMPLETION_FIELDS = {"return_token_ids": True}
_SGLEXT_IDS = ("input_ids", "output_ids")
_CHOICE_IDS = ("token_ids", "prompt_token_ids")
_RAW = msgspec.json.Decoder()
_ENCODE = msgspec.json.Encoder()


def request_fields(chat: bool) -> dict[str, bool]:
    """The top-level body fields that ask the worker for this request's token ids."""
    return dict(_CHAT_FIELDS if chat else _COMPLETION_FIELDS)


class TokenIds:
    """A request's ids, gathered from its answer: one whole body, or each stream chunk in order (the parsed
    ``backends/sglang/wire.py`` Structs). ``None`` until the answer carried them."""

    __slots__ = ("prompt_ids", "output_ids")

    def __init__(self) -> None:
        self.prompt_ids: list[int] | None = None
        self.output_ids: list[int] | None = None

    def take(self, parsed: Any) -> None:
        ext = parsed.sglext
        if ext is not None:
            if ext.input_ids is not None:
                self.prompt_ids = list(ext.input_ids)
            if ext.output_ids:
                self.output_ids = list(ext.output_ids[0])
        for choice in parsed.choices[:1]:  # one choice per request (the gateway refuses n > 1)
            prompt = getattr(choice, "prompt_token_ids", None)  # completions choices only
            if prompt is not None and self.prompt_ids is None:
                self.prompt_ids = list(prompt)
            new = getattr(choice, "token_ids", None)
            if new is not None:
                self.output_ids = [*(self.output_ids or ()), *new]


def strip(raw: bytes) -> bytes:
    """``raw`` (an OpenAI body or stream chunk) without the token-id fields, re-encoded only when it has any
    (its other keys keep their order); an ``sglext`` left empty goes too."""
    if b'_ids"' not in raw:
        return raw
    body = _RAW.decode(raw)
    if not isinstance(body, dict):
        return raw
    changed = False
    ext = body.get("sglext")
    if isinstance(ext, dict):
        for key in _SGLEXT_IDS:
            if key in ext:
                del ext[key]
                changed = True
        if not ext:
            del body["sglext"]
    for choice in body.get("choices") or ():
        if isinstance(choice, dict):
            for key in _CHOICE_IDS:
                if key in choice:
                    del choice[key]
                    changed = True
    return _ENCODE.encode(body) if changed else raw
