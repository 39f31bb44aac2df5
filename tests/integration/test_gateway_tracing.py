"""Trace recording through a real gateway (`specgate serve --trace FILE`) in front of a real `specgate worker`
(real model), driven with the official `openai` client: three requests recorded (chat, streamed chat,
streamed completion), the file read back with `policies.trace.read_trace`, its ids checked against the
worker's usage and the tokenizer, none of them in what the client received or in the gateway's log."""

from __future__ import annotations

import json
import stat
import time

import httpx
import openai
import pytest

from backends.engine.model_store import tokenizer_digest
from bench.processes import ADMIN, MODEL, gateway, write_policy
from policies.trace import TraceError, read_trace
from tests.integration.gateway_processes import policy_text

pytestmark = [pytest.mark.integration, pytest.mark.real_model]
SECRET = "Name one colour of a zebra-quokka-7781."  # a prompt no log line may contain
ID_KEYS = ("input_ids", "output_ids", "token_ids", "prompt_token_ids")


def _ids_in(obj: object) -> list[str]:
    text = json.dumps(obj)
    return [key for key in ID_KEYS if f'"{key}"' in text]


def _read_when_written(path, n: int):
    deadline = time.monotonic() + 20
    while True:
        try:
            trace = read_trace(path)
            if len(trace.requests) >= n:
                return trace
        except (OSError, TraceError):
            pass
        assert time.monotonic() < deadline, f"{n} records did not reach {path}"
        time.sleep(0.2)


def test_three_requests_recorded_and_never_shown_to_the_client(tmp_path, worker_url, revision, real_tokenizer):
    policy = write_policy(tmp_path / "policy.yaml", policy_text([worker_url], revision=revision))
    path = tmp_path / "traces" / "trace.jsonl"
    path.parent.mkdir()
    with gateway(tmp_path, policy, "--trace", str(path)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": SECRET}]
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8,
                                                                temperature=0)
        whole = raw.http_response.json()
        assert _ids_in(whole) == [] and "spec_tokens_details" in whole["sglext"]  # only the ids were taken out
        chat_id = raw.headers["x-specgate-request-id"]

        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert all(_ids_in(c.to_dict()) == [] for c in chunks)
        stream_usage, stream_id = chunks[-1].usage, chunks[-1].model_extra["specgate"]["request_id"]

        prompt = "def add(a, b):\n    return"
        parts = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                               stream_options={"include_usage": True}))
        assert all(_ids_in(c.to_dict()) == [] for c in parts)
        completion_usage, completion_id = parts[-1].usage, parts[-1].model_extra["specgate"]["request_id"]

        trace = _read_when_written(path, 3)
        status = httpx.get(f"{url}/admin/tracing", headers=ADMIN, timeout=10).json()
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    h = trace.header
    assert (h.model, h.revision, h.tokenizer) == (MODEL, revision, tokenizer_digest(real_tokenizer))
    records = {r.id: r for r in trace.requests}
    assert set(records) == {chat_id, stream_id, completion_id}

    chat = records[chat_id]
    template = real_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert chat.prompt_ids == list(getattr(template, "input_ids", template))
    usage = whole["usage"]
    assert (len(chat.prompt_ids), len(chat.output_ids)) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert real_tokenizer.decode(chat.output_ids, skip_special_tokens=True) == whole["choices"][0]["message"]["content"]
    assert (chat.sampling.temperature, chat.sampling.max_new_tokens, chat.served.ttft_s) == (0.0, 8, None)
    assert chat.served.pool == raw.headers["x-specgate-pool"] and chat.served.rule == raw.headers["x-specgate-rule"]

    streamed = records[stream_id]
    assert streamed.prompt_ids == chat.prompt_ids and streamed.output_ids == chat.output_ids  # greedy: the same
    assert (len(streamed.prompt_ids), len(streamed.output_ids)) == (stream_usage.prompt_tokens,
                                                                    stream_usage.completion_tokens)
    assert streamed.served.ttft_s is not None and streamed.served.ttft_s <= streamed.served.e2e_s

    completion = records[completion_id]
    assert completion.prompt_ids == real_tokenizer(prompt)["input_ids"]
    assert (len(completion.prompt_ids), len(completion.output_ids)) == (completion_usage.prompt_tokens,
                                                                        completion_usage.completion_tokens)
    assert completion.features.stream and completion.route == "default"

    assert status["enabled"] and status["path"] == str(path) and status["counts"]["recorded"] == 3
    assert sum(status["counts"].values()) == 3 and status["header"]["revision"] == revision
    assert 'specgate_trace_requests_total{result="recorded"} 3.0' in metrics
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("gateway-*.log"))
    assert "zebra-quokka" not in logs and json.dumps(chat.output_ids)[1:-1] not in logs
