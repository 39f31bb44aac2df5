"""The worker's test-only fault switch: ``--fault-injection``, ``/specgate/fault`` and what /server_info says.

Without the flag the endpoints are 404 in the OpenAI error shape; with it a test toggles the engine's mode
between requests (lossy_accept changes greedy output, random_draft keeps it and accepts no draft) and the
worker reports the mode. The flag is refused at startup on a non-loopback host (settings validation only:
nothing binds 0.0.0.0 here).
"""

from __future__ import annotations

import msgspec
import pytest
from structlog.testing import capture_logs

from backends.sglang.wire import ServerInfo
from backends.net import is_loopback
from backends.worker.settings import WorkerSettings

BASE = [101, 102, 103, 104, 105] * 6
OFF_MESSAGE = ("fault injection is off: start the worker with --fault-injection (a test switch, loopback hosts "
               "only) to use /specgate/fault")


def generate(worker, input_ids, speculation=None) -> dict:
    sampling = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    if speculation is not None:
        sampling["custom_params"] = {"speculation": speculation}
    response = worker.post("/generate", json={"input_ids": input_ids, "sampling_params": sampling})
    assert response.status_code == 200, response.text
    return response.json()


def post_mode(worker, body) -> dict:
    response = worker.post("/specgate/fault", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_without_the_flag_the_endpoints_are_404_and_server_info_says_off(worker):
    want = {"error": {"message": OFF_MESSAGE, "type": "NotFoundError", "param": None, "code": 404}}
    for response in (worker.get("/specgate/fault"), worker.post("/specgate/fault", json={"mode": "lossy_accept"}),
                     worker.post("/specgate/fault", content=b"not json")):
        assert response.status_code == 404 and response.json() == want
    info = worker.get("/server_info").json()
    assert (info["specgate_fault_injection"], info["specgate_fault_mode"]) == (False, "off")
    assert worker.app.state["runtime"].engine.faults.mode == "off"


def test_toggling_the_mode_changes_the_next_requests_and_server_info(worker_factory):
    with worker_factory(fault_injection=True) as worker:
        assert worker.get("/specgate/fault").json() == {"mode": "off"}
        info = msgspec.json.decode(worker.get("/server_info").content, type=ServerInfo)  # the gateway's reading
        assert (info.specgate_fault_injection, info.specgate_fault_mode) == (True, "off")
        echo = generate(worker, BASE)["output_ids"][:16]
        prompt = BASE + echo + BASE  # the n-gram proposer drafts the echo at the end: some drafts accepted
        plain = generate(worker, prompt)["output_ids"]
        exact = generate(worker, prompt, {"proposer": "ngram", "draft_tokens": 4})
        assert exact["output_ids"] == plain and exact["meta_info"]["spec_num_correct_drafts"] > 0

        with capture_logs() as logs:
            assert post_mode(worker, {"mode": "lossy_accept"}) == {"mode": "lossy_accept"}
            assert post_mode(worker, {"mode": "lossy_accept"}) == {"mode": "lossy_accept"}  # no change: no log
        assert logs == [{"event": "fault injection mode changed", "previous": "off", "mode": "lossy_accept",
                         "log_level": "warning"}]
        assert worker.get("/specgate/fault").json() == {"mode": "lossy_accept"}
        info = worker.get("/server_info").json()
        assert (info["specgate_fault_injection"], info["specgate_fault_mode"]) == (True, "lossy_accept")
        lossy = generate(worker, prompt, {"proposer": "ngram", "draft_tokens": 4})
        assert lossy["output_ids"] != plain
        assert generate(worker, prompt)["output_ids"] == plain  # plain requests are untouched

        assert post_mode(worker, {"mode": "random_draft"}) == {"mode": "random_draft"}
        random = generate(worker, prompt, {"proposer": "ngram", "draft_tokens": 4})["meta_info"]
        assert generate(worker, prompt, {"proposer": "ngram", "draft_tokens": 4})["output_ids"] == plain
        assert random["spec_num_proposed_drafts"] > 0
        assert (random["spec_num_correct_drafts"], random["spec_accept_length"]) == (0, 1.0)

        assert post_mode(worker, {"mode": "off"}) == {"mode": "off"}
        assert generate(worker, prompt, {"proposer": "ngram", "draft_tokens": 4})["output_ids"] == plain
        assert worker.app.state["runtime"].engine.faults.mode == "off"


def test_a_bad_mode_is_a_400_naming_the_field_and_the_allowed_values(worker_factory):
    with worker_factory(fault_injection=True) as worker:
        response = worker.post("/specgate/fault", json={"mode": "lossy"})
        assert response.status_code == 400
        assert response.json() == {"error": {
            "message": "mode must be one of off, lossy_accept, random_draft, got 'lossy'",
            "type": "BadRequestError", "param": "mode", "code": 400}}
        response = worker.post("/specgate/fault", json={"mode": "off", "seed": 1})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "invalid request body: Object contains unknown field `seed`"
        assert worker.get("/specgate/fault").json() == {"mode": "off"}


def test_the_launch_mode_is_in_force_from_the_first_step(worker_factory):
    with worker_factory(fault_injection=True, fault_mode="random_draft") as worker:
        assert worker.get("/specgate/fault").json() == {"mode": "random_draft"}
        assert worker.app.state["runtime"].engine.faults.mode == "random_draft"
        assert worker.get("/server_info").json()["specgate_fault_mode"] == "random_draft"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"])
def test_fault_injection_is_allowed_on_loopback_hosts(host):
    assert is_loopback(host)
    assert WorkerSettings(host=host, fault_injection=True, fault_mode="lossy_accept").fault_mode == "lossy_accept"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "example.com", "localhost.example"])
def test_fault_injection_is_refused_on_other_hosts(host):
    assert not is_loopback(host)
    assert WorkerSettings(host=host).fault_injection is False  # off by default: any host is fine
    with pytest.raises(ValueError) as exc:
        WorkerSettings(host=host, fault_injection=True)
    assert str(exc.value) == ("--fault-injection is a test switch and needs a loopback --host (127.0.0.1, ::1 or "
                              f"localhost), got --host {host}")


def test_a_fault_mode_needs_the_flag_and_a_known_mode():
    with pytest.raises(ValueError) as exc:
        WorkerSettings(fault_mode="lossy_accept")
    assert str(exc.value) == ("--fault-mode lossy_accept needs --fault-injection (a test switch; without it the "
                              "worker never injects faults)")
    with pytest.raises(ValueError) as exc:
        WorkerSettings(fault_injection=True, fault_mode="lossy")  # type: ignore[arg-type]
    assert str(exc.value) == "--fault-mode must be one of off, lossy_accept, random_draft, got 'lossy'"
