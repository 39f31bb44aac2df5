"""Server-sent events from an SGLang worker, and text deltas from /generate's cumulative chunks.

SGLang streams ``data: {json}\\n\\n`` events and ends with ``data: [DONE]\\n\\n``
(``http_server.py::generate_request.stream_results``; OpenAI endpoints the same).

/generate text mode. By default every chunk carries the CUMULATIVE ``text`` and ``output_ids``; a
server launched with ``--incremental-streaming-output`` sends only the new part
(``tokenizer_manager.py::_handle_batch_output``). In both modes ``meta_info.completion_tokens`` is
cumulative. ``DeltaTracker`` therefore detects the mode on the first chunk where it matters: a chunk
is cumulative when ``len(output_ids) == completion_tokens`` and its text extends the text so far;
once a chunk has fewer ids than completion tokens the stream is incremental. The first chunk reads the
same either way (nothing came before it). Without ``output_ids`` the prefix check on text decides.
Pass ``incremental=True/False`` to skip detection when the worker's mode is known.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

DONE = b"[DONE]"


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[bytes]:
    """Yield the ``data`` payload of each event (multi-line data joined by ``\\n``), up to [DONE].

    Comments (``:``) and other fields (``event:``, ``id:``) are skipped: SGLang puts everything in
    ``data``. The [DONE] sentinel itself is yielded so callers can tell a complete stream from a cut
    one.
    """
    buffer: list[str] = []
    async for line in lines:
        if line == "":
            if buffer:
                yield "\n".join(buffer).encode()
                buffer = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field != "data":
            continue
        buffer.append(value[1:] if value.startswith(" ") else value)
    if buffer:
        yield "\n".join(buffer).encode()


class DeltaTracker:
    """Turns successive /generate chunks into (new text, new output ids), whatever the mode."""

    def __init__(self, incremental: bool | None = None) -> None:
        self.incremental = incremental
        self.text = ""
        self.output_ids: list[int] = []

    def _detect(self, text: str, output_ids: list[int] | None, completion_tokens: int) -> bool:
        if output_ids is not None and completion_tokens > 0:
            return len(output_ids) < completion_tokens or not text.startswith(self.text)
        return not text.startswith(self.text)

    def push(self, text: str | None, output_ids: list[int] | None,
             completion_tokens: int) -> tuple[str, list[int]]:
        """Feed one chunk; return what it adds to the output. Accumulates the full output."""
        text = text or ""
        if self.incremental is None and (self.text or self.output_ids):
            self.incremental = self._detect(text, output_ids, completion_tokens)
        if self.incremental:
            new_text, new_ids = text, list(output_ids or [])
        else:
            if not text.startswith(self.text):
                raise ValueError(
                    f"cumulative stream text does not extend the previous text "
                    f"({len(self.text)} chars so far); start the client with incremental=True "
                    f"if the worker runs --incremental-streaming-output")
            new_text = text[len(self.text):]
            new_ids = list(output_ids[len(self.output_ids):]) if output_ids is not None else []
        self.text += new_text
        self.output_ids.extend(new_ids)
        return new_text, new_ids
