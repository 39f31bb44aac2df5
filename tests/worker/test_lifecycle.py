"""Startup (503 until the engine is ready), engine failures as SGLang error shapes, overload."""

from __future__ import annotations

import json
import threading
import time

from litestar.testing import TestClient

from backends.engine.types import GenerateRequest
from backends.worker.app import create_app
from backends.worker.settings import WorkerSettings
from tests.engine.engine_helpers import make_tiny_engine


def test_health_is_503_while_the_model_loads(real_tokenizer):
    release = threading.Event()

    def slow_factory(config):
        release.wait(30)
        return make_tiny_engine(real_tokenizer, default_speculation=config.default_speculation)

    with TestClient(create_app(WorkerSettings(calibrate=False, draft_layers=1), slow_factory)) as client:
        starting = client.get("/health")
        assert starting.status_code == 503
        assert starting.json()["error"]["message"] == "the worker is still loading its model; retry shortly"
        assert client.post("/generate", json={"text": "hi"}).status_code == 503
        release.set()
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_engine_failure_is_a_500_or_an_error_chunk(worker):
    engine = worker.app.state["runtime"].engine

    def broken_verify(work, logits, step):
        raise RuntimeError("boom")

    engine._verify = broken_verify  # instance attribute: the engine thread's next round fails
    try:
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 3}}
        plain = worker.post("/generate", json=body)
        assert plain.status_code == 500
        assert plain.json()["error"] == {"message": "internal error: boom", "type": "InternalServerError",
                                         "param": None, "code": 500}
        events = [e[6:] for e in worker.post("/generate", json={**body, "stream": True}).text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2]) == {"error": {"message": "internal error: boom",
                                                    "type": "InternalServerError", "code": 500, "retryable": True}}
    finally:
        del engine._verify
    assert worker.post("/generate", json=body).status_code == 200


def test_full_queue_answers_429_with_the_reason(worker_factory):
    with worker_factory(max_running_requests=1, max_queued_requests=1) as worker:
        engine = worker.app.state["runtime"].engine
        engine.shutdown()  # stop the step loop: a submitted request stays queued, deterministically
        engine.submit(GenerateRequest(rid="parked-1", input_ids=(1, 2, 3)), lambda out: None)
        assert engine.load().num_waiting_reqs == 1  # would take the free running slot: not queued yet
        engine.submit(GenerateRequest(rid="parked-2", input_ids=(1, 2, 3)), lambda out: None)
        refused = worker.post("/generate", json={"text": "b"})
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["message"] == ("the worker's waiting queue is full (2 waiting, 0 running); retry later "
                                    "or on another worker")
        assert (error["type"], error["code"]) == ("TooManyRequests", 429)
        assert worker.post("/generate", json={"text": "b", "sampling_params": {"top_p": 5}}).status_code == 400


def test_idle_health_generates_at_most_every_30_s_and_pings_the_loop_in_between(worker_factory, monkeypatch):
    from backends.worker import runtime as runtime_module

    with worker_factory() as worker:
        runtime = worker.app.state["runtime"]
        engine = runtime.engine
        submitted: list[str] = []
        submit = engine.submit
        monkeypatch.setattr(engine, "submit", lambda request, cb: (submitted.append(request.rid), submit(request, cb)))
        runtime._generated_at -= runtime_module.IDLE_GENERATE_EVERY_S  # the factory's readiness poll generated
        assert worker.get("/health").status_code == 200
        assert len(submitted) == 1 and submitted[0].startswith("HEALTH_CHECK_")  # first: a real generation
        assert [worker.get("/health").status_code for _ in range(3)] == [200] * 3
        assert len(submitted) == 1  # idle and generated < 30 s ago: the engine loop is pinged instead
        assert worker.get("/health_generate").status_code == 200
        assert len(submitted) == 2  # /health_generate always generates
        runtime._generated_at -= runtime_module.IDLE_GENERATE_EVERY_S
        assert worker.get("/health").status_code == 200
        assert len(submitted) == 3  # 30 s later: generates again
        monkeypatch.setattr(runtime_module, "HEALTH_TIMEOUT_S", 0.5)
        engine.shutdown()  # the step loop stops turning: the ping goes unanswered
        stuck = worker.get("/health")
        assert stuck.status_code == 503
        assert stuck.json()["error"]["message"] == "the engine loop did not turn in 0.5 s"
