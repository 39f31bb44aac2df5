"""The trace recorder (gateway/tracing.py, replay/trace_file.py) on ``Finished`` values built here: what it
writes reads back with ``policies.trace.read_trace``; 0600 whatever the umask; rotation keeps whole files;
sampling and the route filter; every request it does not record is counted with its reason; no log line
carries a token id or a prompt."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import structlog

from backends.sglang.wire import ServerInfo
from gateway.stages import OK, Admitted, Arrival, Dispatched, Ending, Finished, Relayed
from replay.trace_file import TraceFile
from gateway.tracing import RESULTS, Recorder, TraceConfig, resolve, sampled
from policies.decide import Decision
from policies.features import RequestFeatures
from policies.schema import Tracing
from policies.trace import read_trace

REVISION = "sha256:" + "ab" * 32
INFO = ServerInfo(served_model_name="SmolLM2-135M-Instruct", revision=REVISION, context_length=8192,
                  specgate_tokenizer_digest="sha256:" + "cd" * 32)
PROMPT_IDS = [1, 9690, 198, 2683, 314, 253, 5356, 30]  # a recognisable run no log line may contain
SECRET = "the-prompt-text-that-must-never-be-logged"


def config(path: Path, **over) -> TraceConfig:
    fields = {"path": path, "max_bytes": 1 << 20, "keep": 2, "sample": 1.0, "seed": 0, "routes": None, **over}
    return TraceConfig(**fields)


def finished(request_id: str = "r1", *, route: str = "default", ids: bool = True, output: int = 5,
             max_tokens: int | None = 64, ending: Ending = OK, worker: str = "http://w:1", stream: bool = True,
             t0: float = 10.0) -> Finished:
    body = {"model": "m", "messages": [{"role": "user", "content": SECRET}], "temperature": 0}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    arrival = Arrival(request_id=request_id, endpoint="chat", t0=t0)
    admitted = Admitted(arrival=arrival, active=None, route=route, body=body,
                        features=RequestFeatures(route=route, prompt_tokens=12, max_tokens=max_tokens),
                        stream=stream, include_usage=False, echo=False, cost_tokens=0, trace_ids=ids)
    decision = Decision(slice="prose", pool="ngram", proposer="ngram", draft_tokens=4, bypass=False,
                        rule="learned", reason="r")
    served = Dispatched(pool="ngram", proposer="ngram", draft_tokens=4, worker=worker, rid=f"{request_id}-1",
                        retries=0, fallback=False, fallback_note="")
    relayed = Relayed(prompt_tokens=len(PROMPT_IDS), completion_tokens=output, ttft_s=0.05,
                      prompt_ids=list(PROMPT_IDS) if ids else None,
                      output_ids=list(range(100, 100 + output)) if ids else None, finish="length")
    return Finished(arrival=arrival, route=route, stream=stream, admitted=admitted, decision=decision,
                    dispatched=served, retries=0, relayed=relayed, ending=ending, e2e_s=0.5, overhead_s=0.001,
                    mean_concurrency=1.0, slo=None, pair_version="")


def recorder(cfg: TraceConfig | None, info: ServerInfo | None = INFO, counted: list[str] | None = None) -> Recorder:
    return Recorder(cfg, worker_info=lambda url: info, count=(counted.append if counted is not None else
                                                               lambda result: None), clock=lambda: 0.0)


def test_a_recorded_file_reads_back_with_its_header(tmp_path):
    counted: list[str] = []
    rec = recorder(config(tmp_path / "t.jsonl"), counted=counted)
    rec.finish(finished("a", t0=1.5))
    rec.finish(finished("b", stream=False, max_tokens=None, output=3, t0=2.0))
    trace = read_trace(tmp_path / "t.jsonl", revision=REVISION)
    h = trace.header
    assert (h.model, h.revision, h.tokenizer, h.pairs, h.source) == \
        ("SmolLM2-135M-Instruct", REVISION, INFO.specgate_tokenizer_digest, {}, "specgate serve")
    a, b = trace.requests
    assert (a.id, a.arrival_s, a.route, a.slice, a.prompt_ids, a.output_ids) == \
        ("a", 1.5, "default", "prose", PROMPT_IDS, [100, 101, 102, 103, 104])
    assert (a.sampling.temperature, a.sampling.max_new_tokens, a.sampling.greedy) == (0.0, 64, True)
    s = a.served
    assert (s.pool, s.rule, s.proposer, s.draft_tokens, s.rounds, s.finish, s.ttft_s, s.e2e_s) == \
        ("ngram", "learned", "ngram", 4, None, "length", 0.05, 0.5)
    assert a.features == RequestFeatures(route="default", prompt_tokens=12, max_tokens=64)
    # no max_tokens and ended by length: the budget was the output; a whole answer has no TTFT
    assert (b.sampling.max_new_tokens, b.served.ttft_s) == (3, None)
    assert counted == ["recorded", "recorded"] and rec.counts["recorded"] == 2
    status = rec.status()
    assert status["enabled"] and status["header"]["revision"] == REVISION
    assert status["files"] == [{"path": str(tmp_path / "t.jsonl"), "bytes": status["bytes"]}]


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077, 0o277])
def test_files_are_created_0600_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        rec = recorder(config(tmp_path / "t.jsonl", max_bytes=3000, keep=1))
        for n in range(6):  # rotates: both the first and a rotated-in file
            rec.finish(finished(f"r{n}", output=40))
    finally:
        os.umask(old)
    files = [tmp_path / "t.jsonl", tmp_path / "t.jsonl.1"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)


def test_rotation_keeps_whole_readable_files_and_drops_the_oldest(tmp_path):
    path = tmp_path / "t.jsonl"
    rec = recorder(config(path, max_bytes=2500, keep=2))
    ids = [f"req-{n:02d}" for n in range(12)]
    for rid in ids:
        rec.finish(finished(rid, output=30))
    assert rec.counts["recorded"] == 12
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"]
    kept = []
    for name in ("t.jsonl.2", "t.jsonl.1", "t.jsonl"):  # oldest first
        data = (tmp_path / name).read_bytes()
        assert len(data) <= 2500 and data.endswith(b"\n")
        trace = read_trace(tmp_path / name, revision=REVISION)
        assert trace.header.revision == REVISION
        kept += [r.id for r in trace.requests]
    assert kept == ids[-len(kept):] and len(kept) < 12  # the newest, in order; the oldest file was dropped
    assert [f["path"] for f in rec.status()["files"]] == [str(path), f"{path}.1", f"{path}.2"]


def test_a_file_found_at_the_path_is_rotated_away_untouched(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"a previous run's trace\n")
    rec = recorder(config(path))
    assert path.read_bytes() == b"a previous run's trace\n"  # nothing happens before the first record
    rec.finish(finished())
    assert (tmp_path / "t.jsonl.1").read_bytes() == b"a previous run's trace\n"
    assert [r.id for r in read_trace(path).requests] == ["r1"]


def test_sampling_is_a_deterministic_fraction_of_request_ids():
    ids = [f"{n:032x}" for n in range(4000)]
    picked = [i for i in ids if sampled(7, i, 0.25)]
    assert 900 <= len(picked) <= 1100  # 1000 expected; binomial sd ~27
    assert picked == [i for i in ids if sampled(7, i, 0.25)]  # same ids, same seed: same requests
    assert picked != [i for i in ids if sampled(8, i, 0.25)]
    assert all(sampled(7, i, 1.0) for i in ids[:50]) and not any(sampled(7, i, 0.0) for i in ids[:50])
    rec = recorder(config(Path("/nonexistent/t.jsonl"), sample=0.25, seed=7))
    assert [rec.select("default", i) for i in ids[:8]] == \
        ["record" if i in picked else "sampled_out" for i in ids[:8]]


def test_route_filter_and_off(tmp_path):
    rec = recorder(config(tmp_path / "t.jsonl", routes=frozenset({"ide"})))
    assert (rec.select("ide", "x"), rec.select("chat", "x")) == ("record", "route_excluded")
    rec.finish(finished("x", route="chat", ids=False))  # admission did not pick it (its route is excluded)
    assert rec.counts["route_excluded"] == 1 and not (tmp_path / "t.jsonl").exists()
    off = recorder(None)
    assert off.select("ide", "x") is None
    off.finish(finished())
    assert sum(off.counts.values()) == 0 and off.status()["enabled"] is False


def test_a_request_picked_at_admission_is_recorded_even_if_a_reload_changed_the_sample(tmp_path):
    path = tmp_path / "t.jsonl"
    rec = recorder(config(path, sample=0.0))  # a reload to sample 0 after the request was admitted and picked
    rec.finish(finished("picked"))
    assert rec.counts["recorded"] == 1
    assert [r.id for r in read_trace(path).requests] == ["picked"]


def test_every_request_not_recorded_is_counted_with_its_reason(tmp_path):
    counted: list[str] = []
    path = tmp_path / "t.jsonl"
    rec = recorder(config(path, max_bytes=2000, sample=1.0), counted=counted)
    rec.finish(finished("failed", ending=Ending(502, "upstream_error", "WorkerError", "boom")))
    rec.finish(finished("no-ids", ids=False))
    rec.finish(finished("invalid", output=20, max_tokens=8))  # more output than max_tokens allowed
    rec.finish(finished("too-large", output=600, max_tokens=1000))
    other = ServerInfo(served_model_name="x", revision="sha256:" + "ef" * 32)
    infos = {"http://w:1": INFO, "http://other:1": other, "http://bare:1": ServerInfo(served_model_name="x")}
    rec.worker_info = infos.get
    rec.finish(finished("first"))  # fixes the header's revision
    rec.finish(finished("other-revision", worker="http://other:1"))
    rec.finish(finished("unknown-worker", worker="http://bare:1"))
    rec.finish(finished("gone-worker", worker="http://gone:1"))
    assert counted == ["failed", "no_ids", "invalid", "too_large", "recorded", "other_revision", "unknown_worker",
                       "unknown_worker"]
    assert set(rec.counts) == set(RESULTS) and sum(rec.counts.values()) == len(counted)
    assert [r.id for r in read_trace(path).requests] == ["first"]


def test_a_failed_write_leaves_the_file_whole_and_the_next_one_succeeds(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    counted: list[str] = []
    rec = recorder(config(path), counted=counted)
    rec.finish(finished("r1"))
    before = path.read_bytes()
    real_write = os.write
    calls = {"n": 0}

    def disk_full(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, bytes(data[:40]))  # a short write: part of the line lands
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("replay.trace_file.os.write", disk_full)
    with structlog.testing.capture_logs() as logs:
        rec.finish(finished("r2"))
    monkeypatch.setattr("replay.trace_file.os.write", real_write)
    assert path.read_bytes() == before  # truncated back to the last whole line
    rec.finish(finished("r3"))
    assert [r.id for r in read_trace(path).requests] == ["r1", "r3"]
    assert counted == ["recorded", "write_error", "recorded"]
    assert rec.status()["last_error"] == f"{path}: No space left on device"
    assert [e["event"] for e in logs] == ["trace_write_failed"]
    _no_content(logs)


def test_a_new_file_whose_header_cannot_be_written_is_removed(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    rec = recorder(config(path))
    def broken(fd, data):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr("replay.trace_file.os.write", broken)
    rec.finish(finished("r1"))
    assert not path.exists() and rec.counts["write_error"] == 1
    monkeypatch.undo()
    rec.finish(finished("r2"))
    assert [r.id for r in read_trace(path).requests] == ["r2"]


def test_no_log_line_carries_ids_or_prompt_text(tmp_path, capsys, caplog):
    rec = recorder(config(tmp_path / "t.jsonl", max_bytes=1500))
    with structlog.testing.capture_logs() as logs:
        rec.finish(finished("ok"))
        rec.finish(finished("invalid", output=20, max_tokens=8))
        rec.finish(finished("too-large", output=600, max_tokens=1000))
        rec.worker_info = lambda url: (_ for _ in ()).throw(RuntimeError(f"bug {PROMPT_IDS} {SECRET}"))
        rec.finish(finished("bug"))
    assert {e["event"] for e in logs} == {"trace_record_invalid", "trace_record_failed"}
    assert rec.counts["invalid"] == 2
    _no_content(logs)
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err + caplog.text and "9690" not in out.out + out.err + caplog.text


def _no_content(logs: list[dict]) -> None:
    text = repr(logs)
    assert SECRET not in text and "9690" not in text and "100, 101" not in text, text


def test_configure_keeps_the_file_for_the_same_path_and_starts_another_for_a_new_one(tmp_path):
    rec = recorder(config(tmp_path / "a.jsonl"))
    rec.finish(finished("r1"))
    rec.configure(config(tmp_path / "a.jsonl", sample=1.0, keep=5))
    rec.finish(finished("r2"))
    assert [r.id for r in read_trace(tmp_path / "a.jsonl").requests] == ["r1", "r2"]
    rec.configure(config(tmp_path / "b.jsonl"))
    rec.finish(finished("r3"))
    assert [r.id for r in read_trace(tmp_path / "b.jsonl").requests] == ["r3"]
    assert [r.id for r in read_trace(tmp_path / "a.jsonl").requests] == ["r1", "r2"]
    rec.configure(None)
    rec.finish(finished("r4"))
    assert rec.counts["recorded"] == 3


def test_resolve_the_flag_names_the_file_and_the_section_the_rest(tmp_path):
    assert resolve(None, None, tmp_path) is None
    only_flag = resolve(None, "/data/t.jsonl", tmp_path)
    assert only_flag == config(Path("/data/t.jsonl"), max_bytes=64 << 20, keep=4)
    section = Tracing(path="traces/t.jsonl", max_bytes=4096, keep=1, sample=0.5, seed=3, routes=["ide"])
    assert resolve(section, None, tmp_path) == TraceConfig(path=tmp_path / "traces/t.jsonl", max_bytes=4096, keep=1,
                                                           sample=0.5, seed=3, routes=frozenset({"ide"}))
    assert resolve(section, "/data/t.jsonl", tmp_path).path == Path("/data/t.jsonl")


def test_trace_file_refuses_a_line_that_fits_no_file(tmp_path):
    from replay.trace_file import TooLarge

    f = TraceFile(tmp_path / "t.jsonl", max_bytes=1024, keep=1)
    with pytest.raises(TooLarge):
        f.write(b"x" * 1000 + b"\n", lambda: b"h" * 30 + b"\n")
    assert f.files() == []


def test_admitted_values_default_to_no_ids():
    a = Admitted(arrival=Arrival(request_id="r", endpoint="chat", t0=0.0), active=SimpleNamespace(), route="r",
                 body={}, features=RequestFeatures(), stream=False, include_usage=False, echo=False, cost_tokens=0)
    assert a.trace_ids is False and Relayed().prompt_ids is None


def test_a_negative_token_id_is_refused_not_written(tmp_path):
    rec = recorder(config(tmp_path / "t.jsonl"))
    f = finished("neg")
    rec.finish(msgspec.structs.replace(f, relayed=msgspec.structs.replace(f.relayed, output_ids=[5, -1])))
    assert rec.counts["invalid"] == 1 and not (tmp_path / "t.jsonl").exists()
