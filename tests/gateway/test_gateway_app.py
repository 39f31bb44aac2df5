"""The app in-process (litestar TestClient) where no worker is needed: its pool points at a closed
port, so every request that passes admission ends in a 503; everything before that is exercised."""

from __future__ import annotations

import threading

import pytest
from litestar.testing import TestClient

from gateway.app import create_app
from cli import main
from gateway.settings import GatewaySettings
from tests.gateway.gateway_helpers import MSG, closed_policy as _policy, closed_port as _closed_port

@pytest.fixture
def client(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGATE_ADMIN_TOKEN", "adm")
    monkeypatch.setenv("KEYS_A", "key-a")
    app = create_app(GatewaySettings(policy_path=str(_policy(tmp_path, "routes: [{name: a, api_keys_env: KEYS_A}]")),
                                     max_body_bytes=2048, monitor_interval_s=30))
    with TestClient(app) as c:
        yield c


def test_statuses_before_and_at_dispatch(client):
    auth = {"authorization": "Bearer key-a"}
    r = client.post("/v1/chat/completions", json=MSG)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = client.post("/v1/chat/completions", content=b"x" * 3000, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = client.post("/v1/chat/completions", content=b"{nope", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post("/v1/chat/completions", json=MSG, headers=auth)
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert (r.headers["x-specgate-slice"], r.headers["x-specgate-rule"], r.headers["x-specgate-route"]) == \
        ("prose", "plain", "a")
    state = client.app.state.gateway
    assert state.in_flight == 0 and state.active.limiters["a"].in_flight == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/"])
def test_the_fast_path_and_litestars_route_answer_alike(client, path):
    """The exact path is served before Litestar's router (GatewayApp), a trailing slash by Litestar's handler:
    the same statuses, errors and headers either way, the body limit included when no content-length says it."""
    auth = {"authorization": "Bearer key-a"}
    chunked = client.post(path, content=iter([b"x" * 1500, b"x" * 1500]), headers=auth)
    assert "content-length" not in chunked.request.headers
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "body_too_large"
    r = client.post(path, json=MSG, headers={**auth, "x-slo-tpot-ms": "0"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-slo-tpot-ms"
    r = client.post(path, json=MSG, headers=auth)
    assert r.status_code == 503 and r.headers["retry-after"] == "2" and r.headers["x-specgate-route"] == "a"
    assert r.json()["error"]["type"] == "service_unavailable"


def test_the_fast_paths_internal_error_is_a_500_in_openais_shape(client, monkeypatch):
    """A bug in the request's owner is answered (500, OpenAI's error shape) and logged, as Litestar's
    exception handler does for its routes; the gateway keeps serving."""
    import structlog

    import gateway.app as app_module

    def broken(state, endpoint, request):
        raise RuntimeError("boom")

    real = app_module.serve
    monkeypatch.setattr(app_module, "serve", broken)
    with structlog.testing.capture_logs() as logs:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers={"authorization": "Bearer key-a"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
    assert [(e["event"], e["path"]) for e in logs] == [("gateway_internal_error", "/v1/completions")]
    monkeypatch.setattr(app_module, "serve", real)
    assert client.get("/health").status_code == 200
    r = client.post("/v1/chat/completions", json=MSG, headers={"authorization": "Bearer key-a"})
    assert r.status_code == 503


def test_admin_needs_its_own_token(client):
    assert client.get("/admin/policy").status_code == 401
    assert client.get("/admin/policy", headers={"authorization": "Bearer key-a"}).status_code == 401
    body = client.get("/admin/policy", headers={"authorization": "Bearer adm"}).json()
    assert body["auth_enabled"] is True and body["api_keys"] == 1 and body["last_reload"]["ok"] is True
    pools = client.get("/admin/pools", headers={"authorization": "Bearer adm"}).json()
    assert pools["plain"]["workers"][0]["healthy"] is False
    assert "ConnectError" in pools["plain"]["workers"][0]["last_error"]


def test_admin_is_closed_without_a_token(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECGATE_ADMIN_TOKEN", raising=False)
    with TestClient(create_app(GatewaySettings(policy_path=str(_policy(tmp_path))))) as c:
        r = c.get("/admin/policy", headers={"authorization": "Bearer x"})
        assert r.status_code == 403 and "SPECGATE_ADMIN_TOKEN" in r.json()["error"]["message"]
        assert c.get("/ready").status_code == 503
        assert "/v1/completions" in c.get("/schema/openapi.json").json()["paths"]


def test_an_app_that_stops_leaves_no_logging_thread_behind(tmp_path):
    # Litestar's default logging config starts a QueueListener thread per app and never stops it
    def listeners() -> int:
        return sum(t.name.endswith("(_monitor)") for t in threading.enumerate())

    before = listeners()
    for _ in range(3):
        with TestClient(create_app(GatewaySettings(policy_path=str(_policy(tmp_path))))) as c:
            assert c.get("/health").status_code == 200
    assert listeners() == before


def test_serve_refuses_public_bind_without_keys(tmp_path, capsys):
    assert main(["serve", "--policy", str(_policy(tmp_path)), "--host", "0.0.0.0"]) == 2
    assert "refusing to listen on 0.0.0.0" in capsys.readouterr().err


def test_startup_freezes_the_heap_and_collects_the_young_generation_less_often():
    import gc

    from cli.serve import GC_YOUNG_THRESHOLD, _freeze_heap

    before = gc.get_threshold()
    try:
        _freeze_heap()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, 10, 10) and GC_YOUNG_THRESHOLD > before[0]
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_serve_rejects_an_invalid_policy(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 2\n")
    assert main(["serve", "--policy", str(bad)]) == 2
    assert "bad.yaml:1:10" in capsys.readouterr().err


def test_mean_concurrency_is_the_in_flight_integral_over_a_requests_life(client):
    """The learner files an outcome under the concurrency the request ran at, not the in-flight count at
    its end (the last request of a burst would otherwise teach the c=1 statistics burst-speed timings)."""
    state = client.app.state.gateway
    t0 = state._busy_t + 1.0
    state.change_in_flight(1, t0)  # A joins alone
    joined = state.busy_area(t0)
    for _ in range(3):
        state.change_in_flight(1, t0 + 1.0)  # B, C, D join a second later
    assert state.busy_area(t0 + 3.0) - joined == 1.0 * 1 + 4.0 * 2  # request-seconds while A ran
    assert (state.busy_area(t0 + 3.0) - joined) / 3.0 == 3.0  # A's mean concurrency
    for _ in range(4):
        state.change_in_flight(-1, t0 + 3.0)
    assert state.in_flight == 0 and state.busy_area(t0 + 10.0) == state.busy_area(t0 + 3.0)


def test_an_outcome_is_filed_under_the_load_its_decision_was_bucketed_by(client, monkeypatch):
    """Other gateways' requests on the same workers count: the load integrated over a request's life is
    load_concurrency's (this gateway's in flight, or the busiest pool's running + waiting per worker when
    more), so the bucket an outcome is learned in is the one a decision at that load looks up."""
    from backends.sglang.pool import PoolSnapshot
    from policies.snapshot import PoolState, load_concurrency

    state = client.app.state.gateway
    backend = state.backend
    busy = {"running": 5, "waiting": 2}
    monkeypatch.setattr(backend, "pool_snapshots", lambda now: {
        "p": PoolSnapshot(name="p", workers=1, healthy_workers=("http://w",), in_flight=0, kv_usage=None,
                          accept_length=None, pair_verified=True, **busy)})
    t0 = state._busy_t + 1.0
    state.change_in_flight(1, t0)  # A joins; this gateway has nothing else in flight
    joined = state.busy_area(t0)
    state.read_worker_load(backend, t0 + 1.0)  # a monitor round: the workers hold A and six from elsewhere
    assert state.busy_area(t0 + 3.0) - joined == 1.0 * 1 + 2.0 * 7
    busy.update(running=1, waiting=0)  # the others finish: this gateway's count (1) is the larger again
    state.read_worker_load(backend, t0 + 3.0)
    assert state.busy_area(t0 + 4.0) - joined == 1.0 * 1 + 2.0 * 7 + 1.0 * 1
    # the decision side: the same measure, plus the request being decided
    assert load_concurrency(0, {"p": PoolState(healthy=True, running=5, waiting=2, workers_healthy=1)}) == 8
    # a replaced backend's late rounds do not touch the integral
    busy.update(running=50)
    stale = type(backend).__new__(type(backend))
    stale.pool_snapshots = backend.pool_snapshots
    before = state.busy_area(t0 + 5.0)
    state.read_worker_load(stale, t0 + 4.0)
    assert state.busy_area(t0 + 5.0) == before
    # the monitor calls it after every round, at the time of the round
    backend.monitor.on_round()
    assert state.busy_area(state._busy_t + 1.0) - state.busy_area(state._busy_t) == 50
    state.change_in_flight(-1, state._busy_t)

def test_an_exploration_is_counted_in_flight_until_its_request_finishes_even_on_failure(client, monkeypatch):
    """decide sees the explorations in flight; each is counted when decided and released when the request ends,
    here after a 503 (the pool's worker is a closed port). The policy only bypasses, so an exploring
    decision is made from the real one with ``explored`` set."""
    import msgspec

    import gateway.lifecycle as lifecycle

    state = client.app.state.gateway
    seen, changes = [], []
    real_decide, real_change = lifecycle.decide, state.change_exploring

    def exploring_decide(*args, exploring, **kwargs):
        seen.append(set(exploring))
        return msgspec.structs.replace(real_decide(*args, exploring=exploring, **kwargs), exploration="thompson")

    def change(key, delta):
        changes.append((key, delta, dict(state.exploring)))
        real_change(key, delta)

    monkeypatch.setattr(lifecycle, "decide", exploring_decide)
    monkeypatch.setattr(state, "change_exploring", change)
    for _ in range(2):
        r = client.post("/v1/chat/completions", json=MSG, headers={"authorization": "Bearer key-a"})
        assert r.status_code == 503
    assert seen == [set(), set()]
    assert changes == [("prose|none", 1, {}), ("prose|none", -1, {"prose|none": 1})] * 2
    assert state.exploring == {} and state.in_flight == 0
    counted = [line for line in client.get("/metrics").text.splitlines() if line.startswith("specgate_explorations_total")]
    assert counted == ['specgate_explorations_total{kind="thompson",pool="plain",proposer="none",route="a",'
                       'slice="prose"} 2.0']


def test_an_invalid_reload_keeps_the_last_good_version_not_the_startup_one(tmp_path, monkeypatch):
    """Valid A (startup) -> valid B -> invalid C: B keeps serving (only B has the rule ``plain-b``).
    The watcher's own loop is kept out of the way (hour-long interval); the test polls it."""
    monkeypatch.setenv("SPECGATE_ADMIN_TOKEN", "adm")
    admin = {"authorization": "Bearer adm"}
    path = _policy(tmp_path)
    a = path.read_text()
    b = a.replace("rules: [{name: plain, then: bypass}]", "rules: [{name: plain-b, then: bypass}]")
    c = b + "bogus: 1\n"
    assert a != b
    settings = GatewaySettings(policy_path=str(path), monitor_interval_s=30, reload_interval_s=3600)
    with TestClient(create_app(settings)) as client:
        watcher = client.app.state.gateway.watcher

        def reload(text: str) -> dict:
            path.write_text(text)
            watcher.poll(force=True)
            return client.get("/admin/policy", headers=admin).json()

        def rule() -> str:
            r = client.post("/v1/chat/completions", json=MSG)
            assert r.status_code == 503  # the pool's worker is a closed port; the decision is made
            return r.headers["x-specgate-rule"]

        assert rule() == "plain"
        version_b = reload(b)["version"]
        assert rule() == "plain-b"
        status = reload(c)
        assert status["last_reload"]["ok"] is False and status["version"] == version_b
        assert status["last_reload"]["errors"][0].startswith("policy.yaml:6:1: bogus")
        assert rule() == "plain-b"


def test_admin_check_answers_404_for_a_pool_without_a_gate(client):
    admin = {"authorization": "Bearer adm"}
    assert client.post("/admin/pools/plain/check").status_code == 401
    r = client.post("/admin/pools/plain/check", headers=admin)
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_such_gate"
    assert r.json()["error"]["message"] == ("pool 'plain' has no pair gate (unknown pool, no pair, or no gates: "
                                            "section in the policy); gated pools: none")
    assert client.get("/admin/pools", headers=admin).json()["plain"]["gate"] is None


def test_a_gated_pool_is_pending_until_its_workers_report_and_a_check_keeps_it_pending(tmp_path, monkeypatch):
    """No worker answers (a closed port), so the gate waits for the pair identity and never runs; a check is
    taken (202) and serves nothing meanwhile."""
    monkeypatch.setenv("SPECGATE_ADMIN_TOKEN", "adm")
    admin = {"authorization": "Bearer adm"}
    worker = f"http://127.0.0.1:{_closed_port()}"
    path = tmp_path / "policy.yaml"
    path.write_text(f"""version: 1
slices: [{{name: prose}}]
pairs:
  p: {{target: {{model: m, revision: "sha256:abc"}}, draft: {{kind: ngram}}}}
pools:
  plain: {{proposer: none, workers: ["{worker}"], speculation: per_request}}
  ngram: {{proposer: ngram, draft_tokens: 4, pair: p, workers: ["{worker}"], speculation: per_request}}
rules: [{{name: ngram, then: {{pool: ngram, draft_tokens: 4}}}}]
gates: {{}}
""")
    with TestClient(create_app(GatewaySettings(policy_path=str(path), monitor_interval_s=30))) as c:
        view = c.get("/admin/pools", headers=admin).json()["ngram"]["gate"]
        assert (view["state"], view["key"], view["reason"]) == ("pending", "", "waiting for the workers' pair identity")
        r = c.post("/admin/pools/ngram/check", headers=admin)
        assert r.status_code == 202 and r.json()["pool"] == "ngram"
        gate = r.json()["gate"]
        assert (gate["state"], gate["reason"], gate["running"]) == ("pending", "re-check requested by an operator",
                                                                    False)
        assert [(e["gate"], e["state"]) for e in gate["history"]] == [("version", "pending"),
                                                                      ("equivalence", "pending")]
        r = c.post("/admin/pools/plain/check", headers=admin)
        assert r.status_code == 404 and r.json()["error"]["message"].endswith("gated pools: ngram")
