"""Per-request bookkeeping in plain Python (no torch): committed ids, stops, text, timing.

Stops are applied token by token over the committed tokens of a round, in SGLang's order (length,
stop token, stop string), so a round that commits n + 1 tokens is cut exactly where plain decoding
would have stopped (docs/architecture.md, "The four properties", 3). Streaming text never shows a possible prefix of a stop
string nor a dangling partial UTF-8 character: what a client has seen is never taken back.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from backends.engine.types import (
    MAX_TOP_LOGPROBS, FinishReason, GenerateRequest, RequestOutput, RequestStats, TokenLogprob,
)

Decode = Callable[[list[int], bool], str]  # (ids, skip_special_tokens) -> text


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    request: GenerateRequest
    decode: Decode
    stop_token_ids: frozenset[int]  # EOS (unless ignore_eos) + stop_token_ids
    context_length: int
    reserved_tokens: int  # KV positions reserved at admission: prompt + max_new_tokens + k + 1
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    prefilled: int = 0  # prompt positions already in the target cache
    cache_len: int = 0
    finish: FinishReason | None = None
    text_end: int | None = None  # where a matched stop string cuts the decoded text
    emitted_ids: int = 0  # output ids already sent in an event
    stats: RequestStats = field(default_factory=RequestStats)
    submitted_at: float = field(default_factory=time.perf_counter)
    abort_requested: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output id, when requested
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per prompt id, when requested

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.request.input_ids

    @property
    def context(self) -> list[int]:
        return [*self.request.input_ids, *self.output_ids]

    @property
    def remaining(self) -> int:
        """Tokens this sequence may still commit (budget and context window)."""
        budget = self.request.sampling.max_new_tokens - len(self.output_ids)
        window = self.context_length - len(self.request.input_ids) - len(self.output_ids)
        return max(0, min(budget, window))

    def commit(self, tokens: list[int]) -> list[int]:
        """Append verified tokens one at a time until a stop fires; return those committed."""
        params = self.request.sampling
        committed: list[int] = []
        for token in tokens:
            self.output_ids.append(token)
            committed.append(token)
            n = len(self.output_ids)
            if n >= params.max_new_tokens or len(self.prompt_ids) + n >= self.context_length:
                self.finish = FinishReason(type="length", length=n)
            elif n >= params.min_new_tokens and token in self.stop_token_ids:
                self.finish = FinishReason(type="stop", matched=token)
            elif params.stop and n >= params.min_new_tokens:
                self._match_stop_string()
            if self.finish is not None:
                break
        return committed

    def _match_stop_string(self) -> None:
        params = self.request.sampling
        text = self.decode(self.output_ids, params.skip_special_tokens)
        hits = [(text.find(s), s) for s in params.stop if s and s in text]
        if hits:
            index, matched = min(hits)
            self.text_end = index + len(matched) if params.no_stop_trim else index
            self.finish = FinishReason(type="stop", matched=matched)

    def visible_text(self) -> str:
        """Text safe to stream: the final text once finished, else without a held-back tail."""
        params = self.request.sampling
        text = self.decode(self.output_ids, params.skip_special_tokens)
        if self.finish is not None:
            return text if self.text_end is None else text[:self.text_end]
        hold = 0
        for stop in params.stop:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    hold = max(hold, size)
                    break
        return text[:len(text) - hold].rstrip("\ufffd")

    def event(self) -> RequestOutput:
        new = tuple(self.output_ids[self.emitted_ids:])
        self.emitted_ids = len(self.output_ids)
        return RequestOutput(
            rid=self.rid,
            new_token_ids=new,
            output_ids=tuple(self.output_ids),
            text=self.visible_text(),
            finished=self.finish is not None,
            finish_reason=self.finish,
            stats=self.stats,
            logprobs=tuple(self.logprobs),
            prompt_logprobs=tuple(self.prompt_logprobs),
        )


class AdmissionError(ValueError):
    """The request can never run on this engine (too long for the KV capacity or context window)."""


def new_sequence(request: GenerateRequest, *, decode: Decode, eos_ids: frozenset[int], vocab: int,
                 context_length: int) -> Sequence:
    """Check a request against the model (raises ValueError / AdmissionError naming the field) and size its
    KV reservation: prompt + max_new_tokens (within the window) + k_max + 1 positions."""
    if not request.input_ids:
        raise ValueError("input_ids is empty; send at least one token")
    if len(request.input_ids) >= context_length:
        raise AdmissionError(
            f"prompt has {len(request.input_ids)} tokens but the model's context window is "
            f"{context_length}; shorten the prompt")
    if any(not 0 <= t < vocab for t in request.input_ids):
        raise ValueError(f"input_ids must be token ids in [0, {vocab})")
    if request.logprobs is not None and not 0 <= request.logprobs <= min(MAX_TOP_LOGPROBS, vocab):
        raise ValueError(f"logprobs must be in [0, {min(MAX_TOP_LOGPROBS, vocab)}], got {request.logprobs}")
    if request.prompt_logprobs and request.logprobs is None:
        raise ValueError("prompt_logprobs needs logprobs (the number of alternatives per token)")
    params = request.sampling
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    k_max = request.speculation.draft_tokens if request.speculation.proposer != "none" else 0
    need = min(len(request.input_ids) + params.max_new_tokens, context_length) + k_max + 1
    return Sequence(request=request, decode=decode, stop_token_ids=frozenset(stops),
                    context_length=context_length, reserved_tokens=need)
