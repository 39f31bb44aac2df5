"""``POST /admin/replay`` (gateway/admin.py) through the app in-process (litestar TestClient), its pools at a
closed port: the policy in force is deploy/policies/default.yaml with a ``tracing:`` section, the recording a
synthetic one written where that section points (as test_replay_candidate's), the cost model hand-made or,
without ``tracing.costs``, a worker's live step costs put where the gateway keeps its workers' last
``/server_info`` (the worker itself is at the closed port). Every refusal with its status and message, one
replay answered, one at a time, and the time bound."""

from __future__ import annotations

import threading
import time

import pytest
from litestar.testing import TestClient

import gateway.admin as admin
from backends.sglang.wire import ServerInfo
from gateway.app import create_app
from gateway.settings import GatewaySettings
from policies.costmodel import write_cost_model
from policies.live_costs import from_server_info
from policies.errors import PolicyError
from policies.load import load_policy
from policies.trace import encode_line, write_trace
from tests.replay.candidate_helpers import DEFAULT, LEFT_OUT, NGRAM_K4, OTHER, REVISION, header, traffic
from tests.gateway.gateway_helpers import closed_port as _closed_port
from tests.replay.replay_helpers import CODE_RATIO, costs

ADMIN = {"authorization": "Bearer adm"}
CANDIDATE = NGRAM_K4.read_text()


@pytest.fixture
def gateway(tmp_path, monkeypatch):
    """``gateway(tracing)``: a TestClient of the default policy with that ``tracing:`` section ("" for none)."""
    monkeypatch.setenv("SPECGATE_ADMIN_TOKEN", "adm")
    (tmp_path / "traces").mkdir()
    clients = []

    def start(tracing: str) -> TestClient:
        path = tmp_path / "policy.yaml"
        path.write_text(DEFAULT.read_text().replace("http://127.0.0.1:30000", f"http://127.0.0.1:{_closed_port()}")
                        + (f"tracing: {tracing}\n" if tracing else ""))
        settings = GatewaySettings(policy_path=str(path), monitor_interval_s=30, reload_interval_s=3600)
        client = TestClient(create_app(settings))
        clients.append(client.__enter__())
        return client

    yield start
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def traced(gateway, tmp_path) -> TestClient:
    """Recording on, with a cost model; the recording itself is each test's to write."""
    write_cost_model(tmp_path / "costs.json", costs(REVISION))
    return gateway("{path: traces/t.jsonl, costs: costs.json}")


def replay(client: TestClient, body: dict | bytes, headers: dict | None = None):
    headers = ADMIN if headers is None else headers
    if isinstance(body, bytes):
        return client.post("/admin/replay", content=body, headers=headers)
    return client.post("/admin/replay", json=body, headers=headers)


def message(r) -> str:
    """The OpenAI-shaped error's message (``{"error": {"message", "type", "param", "code"}}``)."""
    return r.json()["error"]["message"]


def test_refused_while_tracing_is_off(gateway):
    r = replay(gateway(""), {"policy": CANDIDATE})
    assert (r.status_code, message(r)) == (409, "tracing is off: turn it on (tracing: in the policy, or "
                                                        "specgate serve --trace) and let it record")


NO_COST_MODEL = ("no cost model: set tracing.costs to a file from specgate trace calibrate, or serve with a specgate "
                 "worker that calibrates at start-up (no healthy worker reports step costs in /server_info)")


def reported(revision: str = REVISION) -> ServerInfo:
    """A specgate worker's /server_info with its live step costs: one sequence at 1, 2, 5 and 17 tokens, 4 at
    1 and 5 each, calibrated at context 32; ngram and suffix drafted."""
    return ServerInfo(served_model_name="SmolLM2-135M-Instruct", revision=revision, dtype="float32",
                      specgate_step_costs=[(1, 1, 0.02), (1, 2, 0.021), (1, 5, 0.024), (1, 17, 0.036),
                                           (4, 4, 0.03), (4, 20, 0.05)],
                      specgate_step_costs_context=32, specgate_draft_token_s={"ngram": 2e-06, "suffix": 4e-06},
                      specgate_round_overhead_s=0.0005)


def report(client: TestClient, info: ServerInfo, *, healthy: bool = True) -> str:
    """Put ``info`` as the pools' worker's last /server_info (healthy or not); its URL."""
    backend = client.app.state.gateway.backend
    url = next(iter(backend.monitor.clients))  # the default policy's pools share one worker
    backend.info[url] = info
    for pool in backend.pools.values():
        if healthy and url in pool.workers:
            pool.report_success(url, time.monotonic())
    return url


def test_refused_without_a_cost_model(gateway):
    client = gateway("{path: traces/t.jsonl}")
    r = replay(client, {"policy": CANDIDATE})
    assert (r.status_code, message(r)) == (409, NO_COST_MODEL)
    report(client, reported(), healthy=False)  # a worker that is down prices nothing
    r = replay(client, {"policy": CANDIDATE})
    assert (r.status_code, message(r)) == (409, NO_COST_MODEL)


def test_needs_the_admin_token(traced):
    r = replay(traced, {"policy": CANDIDATE}, headers={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"


@pytest.mark.parametrize(("body", "expected"), [
    ({"policy": CANDIDATE, "lats": 5}, "invalid body: Object contains unknown field `lats`"),
    ({"last": 5}, "invalid body: Object missing required field `policy`"),
    ({"policy": CANDIDATE, "last": 0}, "invalid body: Expected `int` >= 1 - at `$.last`"),
    ({"policy": CANDIDATE, "seeds": 11}, "invalid body: Expected `int` <= 10 - at `$.seeds`"),
    ({"policy": CANDIDATE, "loads": []}, "invalid body: Expected `array` of length >= 1 - at `$.loads`"),
    (b"{nope", "invalid JSON: JSON is malformed: object keys must be strings (byte 1)"),
], ids=["unknown-field", "no-policy", "last-0", "seeds-11", "no-loads", "not-json"])
def test_a_bad_body(traced, body, expected):
    r = replay(traced, body)
    assert (r.status_code, message(r)) == (400, expected)


def test_an_invalid_candidate_lists_policy_checks_errors(traced):
    bad = CANDIDATE.replace("then: {pool: ngram, draft_tokens: 4}", "then: {pool: ngramm, draft_tokens: 4}")
    with pytest.raises(PolicyError) as caught:
        load_policy(bad, "candidate.yaml")
    errors = caught.value.errors
    assert len(errors) == 1 and errors[0].startswith("candidate.yaml:") and "unknown pool 'ngramm'" in errors[0]
    r = replay(traced, {"policy": bad})
    assert (r.status_code, message(r), r.json()["errors"]) == (422, "the candidate policy is invalid", errors)


def test_nothing_recorded_yet_and_a_bad_load(traced, tmp_path):
    path = tmp_path / "traces" / "t.jsonl"
    r = replay(traced, {"policy": CANDIDATE})
    assert (r.status_code, message(r)) == (422, f"{path}: no recording yet (nothing was recorded since "
                                                        "tracing was turned on)")
    write_trace(path, header(), traffic(2))
    r = replay(traced, {"policy": CANDIDATE, "loads": ["trace", "x9"]})
    assert (r.status_code, message(r)) == (422, "--loads: 'x9' is not a load; use cN (N closed-loop "
                                                        "clients, e.g. c4), pR (Poisson arrivals at R requests/s, "
                                                        "e.g. p0.5) or trace (the trace's own arrival times)")


def test_the_candidate_and_the_policy_in_force_on_the_newest_recorded_requests(traced, tmp_path):
    path = tmp_path / "traces" / "t.jsonl"
    write_trace(path.with_name("t.jsonl.1"), header(), traffic(2))  # rotated: r0 r1
    write_trace(path, header(), traffic(2, first=2))  # current: r2 r3, and r4 being written
    with path.open("ab") as f:
        f.write(encode_line(traffic(1, first=4)[0])[:40])

    r = replay(traced, {"policy": CANDIDATE, "last": 3, "seeds": 2})
    assert r.status_code == 200
    answer = r.json()
    assert sorted(answer) == ["costs", "excluded_pools", "markdown", "requests", "summary"]
    assert (answer["requests"], answer["excluded_pools"]) == (3, ["draft"])  # r1 r2 r3
    assert answer["costs"] == f"file {tmp_path / 'costs.json'}"
    text = answer["markdown"]
    assert text.startswith(f"# specgate replay: {path}\n\n3 requests (0 sampled")
    assert text.endswith(LEFT_OUT)
    code = text.split("\n## trace / code\n", 1)[1].split("\n## ", 1)[0]
    assert f"\n| candidate / plain | {CODE_RATIO:.3f} | " in code
    assert "\n| candidate / in force | " in code and "\n| in force / plain | " in code
    summary = answer["summary"]
    assert sorted(summary) == ["cells", "ratios"]
    assert sorted(summary["cells"]) == ["candidate|trace", "in force|trace", "plain|trace"]
    assert summary["cells"]["candidate|trace"]["all"]["choices"] == {"ngram-k4": 6}  # 3 requests, 2 seeds
    assert {(x["a"], x["b"]) for x in summary["ratios"]} == {
        ("in force", "plain"), ("candidate", "plain"), ("candidate", "in force")}


def test_one_replay_at_a_time(traced, monkeypatch):
    entered, release = threading.Event(), threading.Event()

    def held(state, config, body, live):  # stands in for the replay: holds the lock until released
        entered.set()
        assert release.wait(60)
        return admin._json({"requests": 0})

    first: list = []
    with monkeypatch.context() as patch:
        patch.setattr(admin, "_replay_now", held)
        thread = threading.Thread(target=lambda: first.append(replay(traced, {"policy": CANDIDATE})))
        thread.start()
        try:
            assert entered.wait(60)
            r = replay(traced, {"policy": CANDIDATE})
            assert (r.status_code, message(r)) == (429, "a replay is already running; retry when it ends")
        finally:
            release.set()
            thread.join()
    assert (first[0].status_code, first[0].json()) == (200, {"requests": 0})
    # the lock was released: the next one runs (and finds nothing recorded)
    assert replay(traced, {"policy": CANDIDATE}).status_code == 422


def test_without_a_cost_model_file_a_workers_live_step_costs_price_it(gateway, tmp_path):
    """Priced exactly as the same costs written to a file (specgate trace calibrate --from-worker) would."""
    write_trace(tmp_path / "traces" / "t.jsonl", header(), traffic(3))
    live = gateway("{path: traces/t.jsonl}")
    url = report(live, reported())
    r = replay(live, {"policy": CANDIDATE, "seeds": 1})
    assert r.status_code == 200
    answer = r.json()
    assert (answer["requests"], answer["costs"]) == (3, f"worker {url} live step costs (one context: 32 tokens)")
    write_cost_model(tmp_path / "live.json", from_server_info(reported(), url))
    filed = replay(gateway("{path: traces/t.jsonl, costs: live.json}"), {"policy": CANDIDATE, "seeds": 1}).json()
    assert filed["costs"] == f"file {tmp_path / 'live.json'}"
    assert answer["summary"] == filed["summary"] and answer["summary"]["cells"]["candidate|trace"]["all"]


def test_live_step_costs_of_another_revision_are_refused(gateway, tmp_path):
    write_trace(tmp_path / "traces" / "t.jsonl", header(), traffic(2))
    client = gateway("{path: traces/t.jsonl}")
    url = report(client, reported(OTHER))
    r = replay(client, {"policy": CANDIDATE, "seeds": 1})
    assert (r.status_code, message(r)) == (422, f"{url}/server_info: field revision: the cost model was calibrated "
                                                f"for model revision {OTHER}, this model is {REVISION}; recalibrate "
                                                "(specgate trace calibrate) on this model")


def test_past_the_time_bound(traced, tmp_path, monkeypatch):
    write_trace(tmp_path / "traces" / "t.jsonl", header(), traffic(2))
    monkeypatch.setattr(admin, "REPLAY_DEADLINE_S", 0)  # checked after each run: the first is past it
    r = replay(traced, {"policy": CANDIDATE, "seeds": 1})
    # plain, the policy in force and the candidate, one seed each
    assert (r.status_code, message(r)) == (504, "the replay passed its 0 s bound after 1 of 3 runs; ask "
                                                        "for fewer requests, seeds or loads")


def test_a_reload_naming_a_missing_cost_model_is_refused_and_the_old_one_kept(traced, tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(path.read_text().replace("costs: costs.json", "costs: gone.json"))
    traced.app.state.gateway.watcher.poll(force=True)
    reload = traced.get("/admin/policy", headers=ADMIN).json()["last_reload"]
    assert (reload["ok"], reload["errors"]) == (False, [
        f"tracing.costs {tmp_path}/gone.json: no such file; write one with specgate trace calibrate --out FILE, or "
        "remove the key"])
    assert traced.app.state.gateway.recorder.config.costs == tmp_path / "costs.json"  # the old policy's
