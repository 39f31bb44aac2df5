"""Helpers shared by the worker tests: the prompt they send and readers of the worker's answers."""

from __future__ import annotations

import json
from typing import Any

import msgspec

REPEAT = "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta alpha beta"
STREAM = {"stream": True, "stream_options": {"include_usage": True}}


def sse(response) -> list:
    """The SSE events of a streamed answer as JSON, [DONE] excluded (checked to be last)."""
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def lost(sent: Any, read: Any, path: str = "$") -> list[str]:
    """Paths of what ``sent`` (the worker's JSON) has and ``read`` (the decoded Struct, as builtins) lacks."""
    if isinstance(sent, dict):
        if not isinstance(read, dict):
            return [path]
        return [p for key, value in sent.items()
                for p in ([f"{path}.{key}"] if key not in read else lost(value, read[key], f"{path}.{key}"))]
    if isinstance(sent, list):
        if not isinstance(read, list) or len(read) != len(sent):
            return [path]
        return [p for i, (a, b) in enumerate(zip(sent, read)) for p in lost(a, b, f"{path}[{i}]")]
    return []


def assert_read_in_full(raw: bytes, kind: type, *, exact: bool = True) -> None:
    """``exact``: the decoded Struct also re-encodes to what was sent (it adds and changes nothing)."""
    sent = msgspec.json.decode(raw)
    read = msgspec.json.decode(msgspec.json.encode(msgspec.json.decode(raw, type=kind)))
    assert lost(sent, read) == [], f"{kind.__name__} drops what the worker sent"
    if exact:
        assert read == sent


def payloads(response) -> list[bytes]:
    """The SSE data payloads, [DONE] excluded (checked to be last)."""
    assert response.status_code == 200, response.text
    events = [e[len(b"data: "):] for e in response.content.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return events[:-1]
