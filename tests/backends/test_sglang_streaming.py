"""Delta reconstruction and SSE framing, chunk by chunk."""

from __future__ import annotations

import asyncio

import pytest

from backends.sglang.streaming import DeltaTracker, sse_data


def test_cumulative_without_output_ids_uses_the_text_prefix():
    tracker = DeltaTracker()
    assert [tracker.push(t, None, 0)[0] for t in ("Hel", "Hello", "Hello, w")] == ["Hel", "lo", ", w"]
    assert tracker.incremental is False and tracker.text == "Hello, w"


def test_incremental_without_output_ids_detected_when_text_stops_extending():
    tracker = DeltaTracker()
    assert [tracker.push(t, None, 0)[0] for t in ("ab", "cd", "ab")] == ["ab", "cd", "ab"]
    assert tracker.incremental is True and tracker.text == "abcdab"


def test_declared_cumulative_rejects_text_that_does_not_extend():
    tracker = DeltaTracker(incremental=False)
    tracker.push("abc", [1, 2, 3], 3)
    with pytest.raises(ValueError, match="start the client with incremental=True"):
        tracker.push("xyz", [4, 5, 6, 7], 4)


def test_empty_first_chunk_defers_detection():
    tracker = DeltaTracker()
    assert tracker.push("", [], 0) == ("", [])
    assert tracker.incremental is None
    assert tracker.push("a", [5], 1) == ("a", [5])
    assert tracker.push("ab", [5, 6], 2) == ("b", [6])
    assert tracker.incremental is False


def test_sse_data_joins_multiline_data_and_skips_comments_and_other_fields():
    lines = [": keep-alive", "event: message", "data: {\"a\":", "data: 1}", "", "",
             "data:[DONE]", ""]

    async def feed():
        for line in lines:
            yield line

    async def collect():
        return [p async for p in sse_data(feed())]

    assert asyncio.run(collect()) == [b'{"a":\n1}', b"[DONE]"]
