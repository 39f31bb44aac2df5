"""The `tracing:` section and `--trace`: strict policy errors (exact messages), `specgate policy check` and
`specgate serve` refusing a missing folder, `GET /admin/tracing`, and reloads: a changed section applies to the
next requests, one whose folder is missing is refused and the old policy kept. In-process gateway whose pool
is a closed port (every request ends in a 503, counted as `failed`)."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from gateway.app import create_app
from cli import main
from gateway.settings import GatewaySettings
from policies.errors import PolicyError
from policies.load import load_policy
from tests.gateway.gateway_helpers import MSG, closed_policy as _policy

ADMIN = {"authorization": "Bearer adm"}
BASE = """version: 1
slices:
  - {name: code, when: {code_score: {gte: 0.5}}}
  - {name: prose}
pairs:
  p: {target: {model: m, revision: r1}, draft: {kind: ngram}}
pools:
  plain: {proposer: none, workers: ["http://w:1"]}
  ngram: {proposer: ngram, draft_tokens: 4, pair: p, workers: ["http://w:1"]}
rules:
  - {name: tiny, when: {max_tokens: {lt: 8}}, then: bypass}
  - {name: code-edits, when: {slice: code}, then: {pool: ngram, draft_tokens: 4}}
  - {name: learned, then: auto}
"""


def errors_of(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        load_policy(text, "p.yaml")
    return info.value.errors


def test_a_valid_section_and_its_defaults():
    policy = load_policy(BASE + "tracing: {path: traces/t.jsonl}\n", "p.yaml")
    t = policy.tracing
    assert (t.path, t.max_bytes, t.keep, t.sample, t.seed, t.routes) == ("traces/t.jsonl", 64 << 20, 4, 1.0, 0, None)
    assert load_policy(BASE, "p.yaml").tracing is None  # off by default


@pytest.mark.parametrize(("section", "expected"), [
    ("{path: t.jsonl, max_byte: 5000}", "p.yaml:14:26: tracing.max_byte: unknown key 'max_byte'; did you mean "
                                        "'max_bytes'?"),
    ("{path: t.jsonl, sample: 1.5}", "p.yaml:14:34: tracing.sample: expected float <= 1.0, got 1.5"),
    ("{path: t.jsonl, max_bytes: 100}", "p.yaml:14:37: tracing.max_bytes: expected int >= 1024, got 100"),
    ("{path: t.jsonl, keep: -1}", "p.yaml:14:32: tracing.keep: expected int >= 0, got -1"),
    ("{path: t.jsonl, routes: [ide]}", "p.yaml:14:35: tracing.routes[0]: unknown route 'ide'; declared routes: "
                                       "default"),
    ("{max_bytes: 5000}", "p.yaml:14:10: tracing: missing required key 'path'"),
    ("t.jsonl", "p.yaml:14:10: tracing: expected mapping | null, got 't.jsonl'"),
])
def test_errors_name_the_field(section, expected):
    assert errors_of(BASE + f"tracing: {section}\n") == [expected]


def test_policy_check_prints_the_section_and_refuses_a_missing_folder(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(BASE + "tracing: {path: traces/t.jsonl, sample: 0.5, routes: [default]}\n")
    assert main(["policy", "check", str(path)]) == 1
    out = capsys.readouterr()
    assert f"  tracing: {tmp_path}/traces/t.jsonl (max 67108864 bytes, keep 4, sample 0.5, seed 0, routes: default)" \
        in out.out
    assert out.err == f"{path}: tracing.path {tmp_path}/traces/t.jsonl: folder {tmp_path}/traces does not exist; " \
                      "create it or change the trace path\n"
    (tmp_path / "traces").mkdir()
    assert main(["policy", "check", str(path)]) == 0
    path.write_text(BASE)
    assert main(["policy", "check", str(path)]) == 0 and "  tracing: off" in capsys.readouterr().out


def test_serve_refuses_a_trace_file_in_a_missing_folder(tmp_path, capsys):
    assert main(["serve", "--policy", str(_policy(tmp_path)), "--trace", str(tmp_path / "no" / "t.jsonl")]) == 2
    assert capsys.readouterr().err == f"error: --trace {tmp_path}/no/t.jsonl: folder {tmp_path}/no does not " \
                                      "exist; create it or change the trace path\n"


def test_admin_status_and_reloads(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGATE_ADMIN_TOKEN", "adm")
    path = _policy(tmp_path)
    plain = path.read_text()
    (tmp_path / "traces").mkdir()
    settings = GatewaySettings(policy_path=str(path), monitor_interval_s=30, reload_interval_s=3600)
    with TestClient(create_app(settings)) as client:
        watcher = client.app.state.gateway.watcher

        def reload(text: str) -> dict:
            path.write_text(text)
            watcher.poll(force=True)
            return client.get("/admin/policy", headers=ADMIN).json()

        def tracing() -> dict:
            return client.get("/admin/tracing", headers=ADMIN).json()

        assert client.get("/admin/tracing").status_code == 401
        assert tracing()["enabled"] is False
        assert client.post("/v1/chat/completions", json=MSG).status_code == 503
        assert sum(tracing()["counts"].values()) == 0  # off: nothing counted

        assert reload(plain + "tracing: {path: traces/t.jsonl, sample: 1.0}\n")["last_reload"]["ok"]
        status = tracing()
        assert (status["enabled"], status["path"], status["keep"]) == (True, str(tmp_path / "traces/t.jsonl"), 4)
        assert client.post("/v1/chat/completions", json=MSG).status_code == 503
        assert tracing()["counts"]["failed"] == 1 and tracing()["files"] == []
        metrics = client.get("/metrics").text
        assert 'specgate_trace_requests_total{result="failed"} 1.0' in metrics

        refused = reload(plain + "tracing: {path: gone/t.jsonl}\n")["last_reload"]
        assert refused["ok"] is False and refused["errors"] == [
            f"tracing.path {tmp_path}/gone/t.jsonl: folder {tmp_path}/gone does not exist; create it or change "
            "the trace path"]
        assert tracing()["path"] == str(tmp_path / "traces/t.jsonl")  # the old policy, tracing included

        assert reload(plain)["last_reload"]["ok"]
        assert tracing()["enabled"] is False


def test_the_flag_turns_recording_on_and_survives_a_reload(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGATE_ADMIN_TOKEN", "adm")
    path = _policy(tmp_path)
    flag = str(tmp_path / "flag.jsonl")
    settings = GatewaySettings(policy_path=str(path), monitor_interval_s=30, reload_interval_s=3600, trace_path=flag)
    with TestClient(create_app(settings)) as client:
        status = client.get("/admin/tracing", headers=ADMIN).json()
        assert (status["path"], status["max_bytes"], status["sample"]) == (flag, 64 << 20, 1.0)
        path.write_text(path.read_text() + "tracing: {path: ignored.jsonl, keep: 9, sample: 0.5}\n")
        client.app.state.gateway.watcher.poll(force=True)
        status = client.get("/admin/tracing", headers=ADMIN).json()
        assert (status["path"], status["keep"], status["sample"]) == (flag, 9, 0.5)  # the flag names the file
