"""`specgate trace build` (replay/trace_build.py): a trace built on the real model replays ngram, suffix and
the self-draft exactly as the engine runs them; its inputs are read strictly."""

from __future__ import annotations

import json
import os
import stat

import pytest

from backends.engine.counterfactual import replay
from replay.trace_build import from_trace
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from cli import main
from replay.trace_build import (
    BuildError, RequestLine, policy_pairs, read_requests, self_draft_pair, served_body, tokenizer_digest,
)
from policies.features import features_from_openai
from policies.load import load_policy
from policies.trace import read_trace
from tests.engine.engine_helpers import RoundLog, run_all, workloads_dir

REQUESTS = [
    {"id": "copy", "route": "app-a", "slice": "code", "body": {"messages": [
        {"role": "user", "content": "Repeat exactly: one two three one two three one two three"}]}},
    {"id": "tools", "route": "app-a", "slice": "tool_call", "body": {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 8,
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]}},
    {"id": "again", "route": "app-b", "body": {"messages": [
        {"role": "user", "content": "Repeat exactly: one two three one two three one two three"}],
        "temperature": 0.9, "stream": True}},
]


def _write_requests(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.real_model
def test_a_built_trace_replays_every_proposer_as_the_engine_runs_it(prepared_model, real_model, real_tokenizer,
                                                                    tmp_path, monkeypatch):
    requests, out = tmp_path / "requests.jsonl", tmp_path / "trace.jsonl"
    _write_requests(requests, REQUESTS)
    assert main(["trace", "build", "--requests", str(requests), "--max-new-tokens", "12", "--draft-layers", "8",
                 "--draft-layers", "20", "--num-threads", "1", "--out", str(out)]) == 0
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    trace = read_trace(out, revision=prepared_model.revision)
    header = trace.header
    assert (header.model, header.tokenizer) == (prepared_model.name, tokenizer_digest(real_tokenizer))
    versions = {pair.draft.layers: version for version, pair in header.pairs.items()}
    assert versions == {8: self_draft_pair(prepared_model.name, prepared_model.revision, 8).version,
                        20: self_draft_pair(prepared_model.name, prepared_model.revision, 20).version}
    assert [(r.id, r.route, r.slice) for r in trace.requests] == [
        ("copy", "app-a", "code"), ("tools", "app-a", "tool_call"), ("again", "app-b", "")]
    for row, record in zip(REQUESTS, trace.requests):
        body = served_body(row["body"], 12)
        assert record.features == features_from_openai(body, route=row["route"])
        assert record.sampling.temperature == 0.0  # traced greedy whatever the client asked
        assert record.sampling.max_new_tokens == min(12, row["body"].get("max_tokens", 12))
        assert record.served.proposer == "none" and record.served.rounds == [(0, 0)] * len(record.output_ids)
    assert trace.requests[0].prompt_ids == trace.requests[2].prompt_ids  # the same chat, rendered once

    # every proposer on a fresh engine (its own suffix store; the 20-layer self-draft) vs replay of the trace
    from backends.engine.config import EngineConfig
    from backends.engine.engine import Engine

    engine = Engine(EngineConfig(model_path=str(prepared_model.path), calibrate=False, draft_layers=20),
                    model=real_model.runner.model, tokenizer=real_tokenizer)
    log = RoundLog(monkeypatch)
    for spec, pair in [(SpeculationParams(proposer="ngram", draft_tokens=4), None),
                       (SpeculationParams(proposer="suffix", draft_tokens=8), None),
                       (SpeculationParams(proposer="draft_model", draft_tokens=4), versions[20])]:
        records, matches = from_trace(trace.requests, pair)
        engine_rounds = []
        for n, record in enumerate(trace.requests):
            request = GenerateRequest(
                rid=f"{spec.proposer}-{n}", input_ids=tuple(record.prompt_ids),
                sampling=SamplingParams(temperature=0.0, max_new_tokens=record.sampling.max_new_tokens),
                speculation=SpeculationParams(proposer=spec.proposer, draft_tokens=spec.draft_tokens,
                                              scope=record.route))
            result = run_all(engine, [request])[request.rid][-1]
            assert list(result.output_ids) == record.output_ids  # greedy: the same output under every proposer
            engine_rounds.append([(r.k, r.accepted) for r in log.of(result)])
        replayed = replay(records, spec, matches=matches)
        assert [list(zip(r.drafted, r.accepted)) for r in replayed] == engine_rounds, spec.proposer
        assert sum(sum(r.accepted) for r in replayed) > 0, spec.proposer  # rounds that accepted were compared


@pytest.mark.real_model
def test_build_from_the_workloads(prepared_model, tmp_path, capsys):
    """Without --workloads (or --requests) the build draws from the default workloads: the sample shipped in
    workloads/, or $SPECGATE_WORKLOADS."""
    out = tmp_path / "trace.jsonl"
    assert main(["trace", "build", "--slices", "tool_call", "--per-slice", "2",
                 "--max-new-tokens", "4", "--route", "ops", "--num-threads", "1", "--out", str(out)]) == 0
    trace = read_trace(out)
    from replay.workloads import sample

    items = sample(workloads_dir(), 2, 0, 6000, ("tool_call",))
    assert [(r.id, r.slice, r.route) for r in trace.requests] == [(i.id, "tool_call", "ops") for i in items]
    assert all(r.features.has_tools and len(r.output_ids) <= 4 for r in trace.requests)
    [version] = trace.header.pairs  # the default: the worker's 8-layer self-draft
    assert trace.header.pairs[version].draft.layers == 8
    printed = capsys.readouterr().out
    assert printed.startswith(f"{out}: 2 requests, ") and f"pair {version} (layer_truncated, 8 layers)" in printed
    for record in trace.requests:  # nothing of the prompt is printed
        assert str(record.prompt_ids[-3:])[1:-1] not in printed


def test_the_requests_file_is_read_strictly(tmp_path):
    path = tmp_path / "requests.jsonl"
    _write_requests(path, [{"id": "a", "body": {"messages": []}}, {"id": "b", "body": {}, "rout": "x"}])
    with pytest.raises(BuildError) as caught:
        read_requests(path)
    assert str(caught.value) == f"{path}:2: Object contains unknown field `rout`"
    _write_requests(path, [{"id": "a", "body": {}}, {"id": "a", "body": {}}])
    with pytest.raises(BuildError) as caught:
        read_requests(path)
    assert str(caught.value) == f"{path}:2: id 'a' already on line 1"
    path.write_text('{"id": "a", "body": {}}\n{"id": "b", "bo\n')
    with pytest.raises(BuildError, match=r"requests.jsonl:2: malformed JSON"):
        read_requests(path)
    path.write_text("\n")
    with pytest.raises(BuildError, match="no requests"):
        read_requests(path)
    _write_requests(path, [{"id": "a", "body": {"messages": []}, "slice": "code"}])
    assert read_requests(path) == [RequestLine(id="a", body={"messages": []}, slice="code")]


def test_served_body_is_greedy_capped_and_plain():
    body = {"messages": [], "temperature": 0.7, "max_completion_tokens": 500, "stream": True,
            "custom_params": {"speculation": {"proposer": "ngram"}}, "top_p": 0.9}
    assert served_body(body, 64) == {"messages": [], "temperature": 0.0, "max_tokens": 64, "top_p": 0.9}
    assert served_body({"messages": [], "max_tokens": 8}, 64) == {"messages": [], "temperature": 0.0, "max_tokens": 8}


POLICY = """version: 1
slices: [{name: prose}]
pairs:
  ng: {target: {model: m, revision: r1}, draft: {kind: ngram}}
  self8: {target: {model: m, revision: r1}, draft: {kind: layer_truncated, layers: 8}}
  self12: {target: {model: m}, draft: {kind: layer_truncated, layers: 12}}
  old: {target: {model: m, revision: r0}, draft: {kind: layer_truncated, layers: 8}}
  sep: {target: {model: m, revision: r1}, draft: {kind: model, model: smaller}}
pools:
  plain: {proposer: none, workers: ["http://w:1"]}
"""


def test_the_policy_pairs_that_need_a_teacher_forced_pass():
    only = load_policy(POLICY.replace("  old:", "  #old:").replace("  sep:", "  #sep:"), "p.yaml")
    assert policy_pairs(only, "r1") == {only.pairs["self8"].version: only.pairs["self8"],
                                        only.pairs["self12"].version: only.pairs["self12"]}
    assert only.pairs["self8"].version == self_draft_pair("m", "r1", 8).version  # a policy's pair, as built
    with pytest.raises(BuildError) as caught:
        policy_pairs(load_policy(POLICY.replace("  sep:", "  #sep:"), "p.yaml"), "r1")
    assert str(caught.value) == ("pair old: target revision r0, but the embedded model is r1; trace the model the "
                                 "pair names")
    with pytest.raises(BuildError) as caught:
        policy_pairs(load_policy(POLICY.replace("  old:", "  #old:"), "p.yaml"), "r1")
    assert str(caught.value) == ("pair sep: draft kind model has no teacher-forced pass yet (only layer_truncated "
                                 "self-drafts of the embedded model)")
