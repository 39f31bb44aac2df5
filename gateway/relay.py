"""Answering: the worker's stream relayed chunk by chunk as it arrives (or assembled into a whole answer that may
resume: ``assemble``), and what the answer tells.

Chunks are forwarded as the exact bytes the worker sent (no re-serialisation). Three are handled:
the ``sglext`` chunk (speculation stats, consumed), the usage chunk (forwarded only when the client
asked for ``stream_options.include_usage``; the gateway always asks the worker for it) and the
finishing chunk, held until the stats arrive so the LAST chunk before ``[DONE]`` can carry the
``specgate`` object, spliced into its JSON text. A worker failure after the first byte is resumed on another
worker when the request may (``gateway/resume.py``: its chunks then arrive already in this stream's shape);
otherwise it surfaces as ``WorkerError`` to the request's owner (``gateway.lifecycle.serve``), which ends the
stream with an OpenAI-style error event and ``[DONE]``; a client that goes away is the owner's business too. A
request selected for the trace, or a stream that may resume, also has its token ids taken out of every chunk
the client gets (``backends/sglang/token_ids.py``); the rest pay nothing for it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from backends.sglang.client import OpenAIResult
from backends.sglang.errors import WorkerError
from backends.sglang.openai_wire import SglExt
from backends.sglang.spec_stats import SpecStats, spec_stats_from_sglext
from backends.sglang.token_ids import TokenIds, strip
from gateway.stages import Admitted, Relayed

if TYPE_CHECKING:
    from gateway.holds import Stopwatch
    from gateway.resume import Resumer

DONE = b"data: [DONE]\n\n"
_JSON = msgspec.json.Encoder()


def inject(raw: bytes, info: bytes) -> bytes:
    """Add ``"specgate": info`` to the JSON object text ``raw`` without re-encoding it."""
    body = raw.rstrip()
    return body[:-1] + b',"specgate":' + info + b"}"


def worker_decode_s(sglext: SglExt) -> float | None:
    """The worker's own decode time of the first choice (``specgate_decode_s`` in
    ``sglext.spec_tokens_details``: specgate's embedded worker sends it, a real SGLang server does not)."""
    details = sglext.spec_tokens_details
    if isinstance(details, list):
        details = details[0] if details else None
    return details.specgate_decode_s if details is not None else None


class Tally:
    """What the answer has told so far (usage, speculation counters, first-token time, the worker's decode
    time, and the token ids and finish reason once ``want_ids`` was called); ``relayed()`` freezes it into the
    stage value (kept until the tally changes: a whole answer's is built once for its ``specgate`` object and
    its ``Finished``)."""

    __slots__ = ("t0", "prompt_tokens", "completion_tokens", "stats", "ttft_s", "decode_s", "ids", "finish",
                 "_frozen")

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.prompt_tokens = self.completion_tokens = 0
        self.stats: SpecStats | None = None
        self.ttft_s: float | None = None
        self.decode_s: float | None = None
        self.ids: TokenIds | None = None
        self.finish: str | None = None
        self._frozen: Relayed | None = None

    def want_ids(self) -> None:
        self.ids = TokenIds()
        self._frozen = None

    def take(self, parsed: Any) -> None:
        self._frozen = None
        if parsed.usage is not None:
            self.prompt_tokens = parsed.usage.prompt_tokens
            self.completion_tokens = parsed.usage.completion_tokens
        if parsed.sglext is not None:
            self.stats = spec_stats_from_sglext(parsed.sglext) or self.stats
            if (decode_s := worker_decode_s(parsed.sglext)) is not None:
                self.decode_s = decode_s
        if self.ids is not None:
            self.ids.take(parsed)
            for choice in parsed.choices[:1]:
                self.finish = choice.finish_reason or self.finish

    def first_token(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.t0
            self._frozen = None

    def relayed(self) -> Relayed:
        if self._frozen is not None:
            return self._frozen
        ids = self.ids
        self._frozen = frozen = Relayed(
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens, stats=self.stats,
            ttft_s=self.ttft_s, decode_s=self.decode_s, prompt_ids=ids.prompt_ids if ids else None,
            output_ids=ids.output_ids if ids else None, finish=self.finish)
        return frozen


def _same(raw: bytes) -> bytes:
    return raw


def _has_content(parsed: Any, chat: bool) -> bool:
    for choice in parsed.choices:
        if chat:
            if choice.delta.content or choice.delta.tool_calls:
                return True
        elif choice.text:
            return True
    return False


async def continued(tally: Tally, upstream: AsyncIterator[OpenAIResult[Any]], first: OpenAIResult[Any],
                    waited: Stopwatch, resumer: Resumer | None) -> AsyncIterator[tuple[OpenAIResult[Any], bool]]:
    """The worker's chunks from ``first`` on, each told to ``tally`` (and to the resumer's progress), with whether
    it is a ``special`` one (the sglext or usage chunk). With a ``resumer`` a worker failure before the finishing
    chunk continues on another worker (``gateway/resume.py``: its chunks arrive in this stream's shape)."""
    progress = resumer.progress if resumer is not None else None
    finished = False
    item: OpenAIResult[Any] | None = first
    while item is not None:
        parsed = item.parsed
        special = parsed.sglext is not None or (parsed.usage is not None and not parsed.choices)
        tally.take(parsed)
        if not special:
            if progress is not None:
                progress.take(parsed)
            finished = finished or any(c.finish_reason for c in parsed.choices)
        yield item, special
        with waited:
            try:
                item = await anext(upstream, None)
            except WorkerError as exc:
                if resumer is None or finished:
                    raise
                upstream = await resumer.resume(exc)  # raises exc when it cannot
                item = await anext(upstream, None)


async def assemble(tally: Tally, admitted: Admitted, upstream: AsyncIterator[OpenAIResult[Any]],
                   first: OpenAIResult[Any], info: Callable[[], bytes], waited: Stopwatch,
                   resumer: Resumer | None) -> bytes:
    """A whole answer's JSON built from its worker's stream (``resume.whole_answers``: a whole answer streamed
    from the worker so that it can resume): the body the worker would have answered whole (one choice: its text,
    logprobs, finish reason and matched stop; usage; the sglext speculation details), with ``specgate``. Token
    ids are never in it, and neither is the worker's ``metadata``."""
    chat = admitted.arrival.endpoint == "chat"
    head: Any = None
    text: list[str] = []
    logprobs: list[Any] = []  # each chunk's choice logprobs
    finish = matched = usage = sglext = None
    async for item, special in continued(tally, upstream, first, waited, resumer):
        parsed = item.parsed
        if head is None and parsed.id:
            head = parsed
        if special:
            usage = parsed.usage if parsed.usage is not None else usage
            sglext = parsed.sglext if parsed.sglext is not None else sglext
            continue
        for c in parsed.choices[:1]:
            piece = c.delta.content if chat else c.text
            if piece:
                text.append(piece)
            if c.logprobs is not None:
                logprobs.append(c.logprobs)
            if c.finish_reason:
                finish, matched = c.finish_reason, c.matched_stop
    content = "".join(text)
    choice: dict[str, Any] = {"index": 0}
    if chat:
        entries = [e for lp in logprobs for e in lp.content or ()]
        choice.update(message={"role": "assistant", "content": content, "reasoning_content": None, "tool_calls": None},
                      logprobs={"content": msgspec.to_builtins(entries)} if logprobs else None)
    else:
        choice.update(text=content, logprobs=_completion_logprobs(logprobs) if logprobs else None)
    choice.update(finish_reason=finish, matched_stop=matched)
    body: dict[str, Any] = {"id": head.id if head else "", "object": "chat.completion" if chat else "text_completion",
                            "created": head.created if head else 0, "model": head.model if head else "",
                            "choices": [choice]}
    if usage is not None:
        body["usage"] = msgspec.to_builtins(usage)
    if sglext is not None and sglext.spec_tokens_details is not None:
        body["sglext"] = {"spec_tokens_details": msgspec.to_builtins(sglext.spec_tokens_details)}
    return inject(_JSON.encode(body), info())


def _completion_logprobs(parts: list[Any]) -> dict[str, Any]:
    """Completions logprobs of a whole answer: the chunks' lists joined (their text offsets are absolute)."""
    tops = [t for lp in parts for t in (lp.top_logprobs or [None] * len(lp.tokens))]
    return {"tokens": [t for lp in parts for t in lp.tokens],
            "token_logprobs": [v for lp in parts for v in lp.token_logprobs],
            "top_logprobs": tops if any(lp.top_logprobs for lp in parts) else None,
            "text_offset": [o for lp in parts for o in lp.text_offset]}


async def relay_stream(tally: Tally, admitted: Admitted, upstream: AsyncIterator[OpenAIResult[Any]],
                       first: OpenAIResult[Any], info: Callable[[], bytes], waited: Stopwatch,
                       resumer: Resumer | None = None, ids: bool = False) -> AsyncIterator[bytes]:
    """The client's SSE bytes, through ``[DONE]``; ``info()`` is the ``specgate`` object at the end. With a
    ``resumer`` a worker failure before the finishing chunk continues the stream on another worker
    (``gateway/resume.py``: its chunks arrive already in this stream's shape); ``ids``: the worker was asked for
    token ids (for the trace or a resume), which are taken out of every chunk."""
    chat = admitted.arrival.endpoint == "chat"
    clean = strip if ids or admitted.trace_ids else _same  # the worker's token ids never reach the client
    held_finish: bytes | None = None
    usage_raw: bytes | None = None
    echo_pending = admitted.echo
    async for item, special in continued(tally, upstream, first, waited, resumer):
        parsed = item.parsed
        if special:
            if parsed.usage is not None:
                usage_raw = item.raw
        elif any(c.finish_reason for c in parsed.choices):
            held_finish = clean(item.raw)
            tally.first_token()
        else:
            if tally.ttft_s is None and _has_content(parsed, chat):
                if echo_pending:  # the echoed prompt, sent before any token is generated
                    echo_pending = False
                else:
                    tally.first_token()
            yield b"data: " + clean(item.raw) + b"\n\n"
    if held_finish is not None and usage_raw is not None and admitted.include_usage:
        yield b"data: " + held_finish + b"\n\n"
        yield b"data: " + inject(usage_raw, info()) + b"\n\n"
    elif held_finish is not None:
        yield b"data: " + inject(held_finish, info()) + b"\n\n"
    elif usage_raw is not None and admitted.include_usage:
        yield b"data: " + inject(usage_raw, info()) + b"\n\n"
    yield DONE
