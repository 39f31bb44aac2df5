"""The trace format (policies/trace.py): round trip, 0600 whole-or-nothing writes, and exact errors naming
the file, line and field for every kind of bad line."""

from __future__ import annotations

import json
import os
import stat

import msgspec
import pytest

from policies.features import RequestFeatures
from policies.schema import DraftId, ModelId, Pair, pair_version
from policies.trace import FORMAT, Header, Sampling, Served, TraceError, TraceRequest, read_trace, write_trace

REVISION = "sha256:" + "ab" * 32
PAIR = Pair(target=ModelId(model="SmolLM2-135M-Instruct", revision=REVISION),
            draft=DraftId(kind="layer_truncated", layers=8))
VERSION = pair_version(PAIR)
HEADER = Header(format=FORMAT, model="SmolLM2-135M-Instruct", revision=REVISION, tokenizer="sha256:" + "cd" * 32,
                pairs={VERSION: PAIR}, created="2025-01-01T00:00:00+00:00", source="test")


def request(rid: str = "r1", **changes) -> TraceRequest:
    fields = dict(
        id=rid, arrival_s=0.5, route="default", slice="code", features=RequestFeatures(prompt_tokens=3),
        sampling=Sampling(temperature=0.0, max_new_tokens=8),
        served=Served(proposer="none", draft_tokens=0, rounds=[(0, 0)] * 4, finish="stop", ttft_s=0.1, e2e_s=0.4),
        draft_matches={VERSION: "0110"}, prompt_ids=[1, 2, 3], output_ids=[4, 5, 6, 2])
    return TraceRequest(**{**fields, **changes})


def lines(*items) -> bytes:
    return b"".join(msgspec.json.encode(item) + b"\n" if not isinstance(item, bytes) else item for item in items)


@pytest.fixture
def trace_file(tmp_path):
    def write(data: bytes):
        path = tmp_path / "t.jsonl"
        path.write_bytes(data)
        return path
    return write


def test_a_written_trace_reads_back_equal_and_is_private(tmp_path):
    path = tmp_path / "trace.jsonl"
    records = [request("a"), request("b", served=Served(proposer="draft_model", draft_tokens=4, pool="draft",
                                                          rule="code", rounds=[(4, 1), (4, 1)], finish="length"))]
    assert write_trace(path, HEADER, records) == 2
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    trace = read_trace(path, revision=REVISION)
    assert trace.header == HEADER and trace.requests == records
    first = json.loads(path.read_bytes().splitlines()[0])
    assert first["kind"] == "header" and first["format"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["trace.jsonl"]


def test_prompt_repeat_is_recorded_and_traces_older_than_it_still_read(trace_file):
    records = [request("new", features=RequestFeatures(prompt_tokens=3, code_score=0.4, prompt_repeat=0.3333))]
    assert read_trace(trace_file(lines(HEADER, *records))).requests == records
    old = msgspec.to_builtins(request("old", features=RequestFeatures(prompt_tokens=3, code_score=0.4)))
    del old["features"]["prompt_repeat"]  # written before the feature existed
    assert "prompt_repeat" not in json.dumps(old)
    (read,) = read_trace(trace_file(lines(HEADER, msgspec.json.encode(old) + b"\n"))).requests
    assert (read.features.prompt_repeat, read.features.code_score) == (0.0, 0.4)


def test_a_failed_write_leaves_nothing(tmp_path):
    path = tmp_path / "trace.jsonl"

    def failing():
        yield request("a")
        raise RuntimeError("model failed")

    with pytest.raises(RuntimeError):
        write_trace(path, HEADER, failing())
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_keeps_the_previous_trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(path, HEADER, [request("old")])

    def failing():
        raise RuntimeError("model failed")
        yield  # pragma: no cover

    with pytest.raises(RuntimeError):
        write_trace(path, HEADER, failing())
    assert [r.id for r in read_trace(path).requests] == ["old"]


@pytest.mark.parametrize(("data", "message"), [
    (b"", "{path}: empty; a trace starts with its header line"),
    (lines(HEADER, request()) + b'{"kind": "request", "id": "r2", "arr',
     "{path}:3: truncated: the last line has no newline (the writer stopped mid-line); rebuild the trace or drop "
     "that line"),
    (lines(HEADER, b'{"kind": "request", "id": "r2", "arr\n'), "{path}:2: malformed JSON (Input data was truncated)"),
    (lines(request()), "{path}:1: field kind: expected the header line first, got a request"),
    (lines(HEADER, HEADER), "{path}:2: field kind: a second header (the header is line 1 only)"),
    (lines(HEADER, request(), request()), "{path}:3: field id: request id 'r1' already on line 2"),
    (lines(HEADER, b"\n"), "{path}:2: empty line"),
    (lines(HEADER, b'{"kind": "reply"}\n'), "{path}:2: field kind: invalid value 'reply'"),
    (lines(HEADER, msgspec.json.encode({**msgspec.to_builtins(request()), "extra": 1}) + b"\n"),
     "{path}:2: field extra: unknown field (trace format 1)"),
    (lines(HEADER, msgspec.json.encode({**msgspec.to_builtins(request()),
                                        "served": {**msgspec.to_builtins(request().served), "k": 4}}) + b"\n"),
     "{path}:2: field served.k: unknown field (trace format 1)"),
    (lines(HEADER, msgspec.json.encode({**msgspec.to_builtins(request()), "output_ids": [4, 5, -6, 2]}) + b"\n"),
     "{path}:2: field output_ids[2]: expected `int` >= 0"),
    (lines(HEADER, msgspec.json.encode({**msgspec.to_builtins(request()),
                                        "served": {**msgspec.to_builtins(request().served),
                                                   "rounds": [[0, "0"]]}}) + b"\n"),
     "{path}:2: field served.rounds[0][1]: expected `int`, got `str`"),
    (lines(HEADER, msgspec.json.encode({k: v for k, v in msgspec.to_builtins(request()).items()
                                        if k != "sampling"}) + b"\n"),
     "{path}:2: field sampling: missing (a required field)"),
    (lines(msgspec.json.encode({**msgspec.to_builtins(HEADER), "format": 2}) + b"\n"),
     "{path}:1: field format: invalid enum value 2"),
])
def test_a_bad_line_is_named_with_its_field(trace_file, data, message):
    path = trace_file(data)
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    assert str(caught.value) == message.format(path=path)


@pytest.mark.parametrize(("changes", "message"), [
    ({"draft_matches": {VERSION: "011"}}, f"field draft_matches.{VERSION}: 3 flags for 4 output tokens"),
    ({"draft_matches": {VERSION: "01x0"}}, "field draft_matches[...]: expected `str` matching regex '^[01]*$'"),
    ({"output_ids": list(range(9))}, "field output_ids: 9 tokens, over sampling.max_new_tokens 8"),
    ({"prompt_ids": []}, "field prompt_ids: empty"),
    ({"served": {"proposer": "ngram", "draft_tokens": 4, "rounds": [[2, 3]], "finish": "stop"}},
     "field served.rounds[0]: accepted 3 > drafted 2"),
    ({"served": {"proposer": "ngram", "draft_tokens": 4, "rounds": [[2, 2], [2, 0], [1, 0]], "finish": "stop"}},
     "field served.rounds: 3 rounds cannot commit 4 tokens"),
    ({"served": {"proposer": "ngram", "draft_tokens": 4, "rounds": [[2, 1]], "finish": "stop"}},
     "field served.rounds: 1 rounds cannot commit 4 tokens"),
])
def test_a_request_that_contradicts_itself_is_refused(trace_file, changes, message):
    body = {**msgspec.to_builtins(request()), **changes}
    path = trace_file(lines(HEADER, msgspec.json.encode(body) + b"\n"))
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    assert str(caught.value) == f"{path}:2: {message}"


def test_a_stop_may_cut_the_last_round():
    # 4 tokens: a round of (2, 2) commits 3, the last round (3, 3) would commit 4 but a stop cut it to 1
    request(served=Served(proposer="ngram", draft_tokens=3, rounds=[(2, 2), (3, 3)], finish="stop"))
    request(served=Served(proposer="ngram", draft_tokens=3, rounds=None, finish="stop"))  # totals only


def test_a_trace_of_another_model_revision_is_refused(trace_file):
    path = trace_file(lines(HEADER, request()))
    other = "sha256:" + "ef" * 32
    with pytest.raises(TraceError) as caught:
        read_trace(path, revision=other)
    assert str(caught.value) == (f"{path}:1: field revision: the trace was recorded on model revision {REVISION}, "
                                 f"this model is {other}; build a trace with this model (specgate trace build)")


def test_pairs_are_checked_against_their_versions_and_the_target(trace_file):
    other = Pair(target=ModelId(model="SmolLM2-135M-Instruct", revision=REVISION),
                 draft=DraftId(kind="layer_truncated", layers=6))
    header = {**msgspec.to_builtins(HEADER), "pairs": {VERSION: msgspec.to_builtins(other)}}
    path = trace_file(lines(msgspec.json.encode(header) + b"\n"))
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    assert str(caught.value) == f"{path}:1: field pairs.{VERSION}: the pair listed has version {pair_version(other)}"

    foreign = Pair(target=ModelId(model="SmolLM2-135M-Instruct", revision="sha256:00"),
                   draft=DraftId(kind="layer_truncated", layers=8))
    header = {**msgspec.to_builtins(HEADER), "pairs": {pair_version(foreign): msgspec.to_builtins(foreign)}}
    path = trace_file(lines(msgspec.json.encode(header) + b"\n"))
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    assert str(caught.value) == (f"{path}:1: field pairs.{pair_version(foreign)}.target.revision: sha256:00, but "
                                 f"the trace's target is {REVISION}")

    unknown = "0" * 12
    path = trace_file(lines(HEADER, request(draft_matches={unknown: "0110"})))
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    assert str(caught.value) == f"{path}:2: field draft_matches.{unknown}: pair version not in the header's pairs"
