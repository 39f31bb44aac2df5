"""`specgate up` (what `make serve` runs): the default policy's worker and the gateway start, answer the
official openai client with a decision, and all stop on SIGTERM."""

from __future__ import annotations

import signal

import httpx
import openai
import pytest

from bench.processes import BIN, REPO, free_port, running

pytestmark = [pytest.mark.integration, pytest.mark.real_model]


def test_up_serves_the_default_policy_and_stops_everything_on_sigterm(tmp_path):
    worker_port, gateway_port = free_port(), free_port()
    text = (REPO / "deploy" / "policies" / "default.yaml").read_text()
    assert '"http://127.0.0.1:30000"' in text
    policy = tmp_path / "default.yaml"
    policy.write_text(text.replace("127.0.0.1:30000", f"127.0.0.1:{worker_port}"))
    argv = [str(BIN / "specgate"), "up", "--policy", str(policy), "--port", str(gateway_port),
            "--log-dir", str(tmp_path), "--worker-arg=--no-calibrate", "--worker-arg=--num-threads=1"]
    base = f"http://127.0.0.1:{gateway_port}"
    with running(argv, f"{base}/ready", tmp_path / "up.log") as up:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)  # a 5xx must fail
        raw = client.chat.completions.with_raw_response.create(
            model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": "Say hi"}])
        reply = raw.parse()
        assert raw.headers["x-specgate-slice"] == "prose"
        assert raw.headers["x-specgate-pool"] in ("plain", "ngram", "draft")
        assert reply.usage.completion_tokens <= 4 and reply.choices[0].message.content
        assert httpx.get(f"http://127.0.0.1:{worker_port}/health", timeout=5).status_code == 200
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{worker_port}/health", timeout=2)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/health", timeout=2)
    assert "worker" in (tmp_path / "up.log").read_text()
