"""The ids a stream chunk carries when asked for (backends/worker/responses.py): only the ids whose text that
chunk's text completes, so the ids a client has seen always spell the text it has seen (what the gateway
resumes from: gateway/resume.py). The engine holds back a possible stop-string prefix; a skipped special token
adds no text."""

from __future__ import annotations

import json

import msgspec

from backends.engine.types import FinishReason, RequestOutput, RequestStats
from backends.worker.responses import OpenAIShaper


class Texts:
    """TokenTexts over a made-up vocabulary: id -> its bytes; 0 is a special token."""

    PIECES = {0: b"<|im_start|>", 1: b"Hello", 2: b" wor", 3: b"ld", 4: b" S", 5: b"TOP"}

    def get(self, token_id: int) -> tuple[bytes, str]:
        raw = self.PIECES[token_id]
        return raw, raw.decode()

    def streamed_bytes(self, token_id: int, skip_special_tokens: bool) -> int:
        return 0 if skip_special_tokens and token_id == 0 else len(self.PIECES[token_id])


def out(ids: tuple[int, ...], text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid="r", new_token_ids=(), output_ids=ids, text=text, finished=finished,
                         finish_reason=FinishReason(type="stop", matched="STOP") if finished else None,
                         stats=RequestStats())


def chunk_ids(shaper: OpenAIShaper, event: RequestOutput) -> list[int] | None:
    body = json.loads(msgspec.json.encode(shaper.chunk(event)))
    return body["choices"][0].get("token_ids")


def test_a_chat_chunk_sends_an_id_only_with_its_text():
    shaper = OpenAIShaper(chat=True, rid="r", model="m", prompt_tokens=3, weight_version="", spec_details=False,
                          texts=Texts(), prompt_ids=[7, 8, 9], input_ids=True, output_ids=True)
    first = json.loads(msgspec.json.encode(shaper.first_chunk()))
    assert first["choices"][0]["prompt_token_ids"] == [7, 8, 9] and "token_ids" not in first["choices"][0]
    assert chunk_ids(shaper, out((0, 1), "Hello")) == [0, 1]  # the skipped special token adds no text
    assert chunk_ids(shaper, out((0, 1, 2), "Hello wor")) == [2]
    # the engine holds " S" back (a prefix of the stop " STOP"): its id waits for its text, "ld"'s goes
    assert chunk_ids(shaper, out((0, 1, 2, 3, 4), "Hello world")) == [3]
    assert chunk_ids(shaper, out((0, 1, 2, 3, 4, 5), "Hello world", finished=True)) == [4, 5]  # all, once finished


def test_without_skipping_special_tokens_their_text_counts():
    shaper = OpenAIShaper(chat=False, rid="r", model="m", prompt_tokens=1, weight_version="", spec_details=False,
                          texts=Texts(), output_ids=True, skip_special_tokens=False)
    assert chunk_ids(shaper, out((0, 1), "<|im_start|>")) == [0]
    assert chunk_ids(shaper, out((0, 1), "<|im_start|>Hello")) == [1]
