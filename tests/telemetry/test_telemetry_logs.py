"""Logs: one structured line per request with its fields; no text unless debug; keys never logged."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from gateway.telemetry_views import policy_view
from policies.load import load_policy_file
from telemetry import RequestRecord, Telemetry
from telemetry.logs import configure_logging, mask_secrets

POLICY = policy_view(load_policy_file(Path(__file__).with_name("policy.yaml")))
PROMPT = "Refactor this function: def add(a, b): return a+b"
COMPLETION = "def add(a: int, b: int) -> int:"
KEY = "sk-proj-Zq8vR2mX4nT7kL1pW9sB3dF6gH0jA5cE"


def _record(**kw) -> RequestRecord:
    base = dict(request_id="req-42", route="ide", slice="code", pool="ngram", proposer="ngram", rule="code-ngram",
                reason="rule 'code-ngram' pins pool 'ngram' with k=4", draft_tokens=4, prompt_tokens=17,
                completion_tokens=12, ttft_s=0.1234, tpot_s=0.021, tpot_source="stream", e2e_s=0.3544, verify_ct=5,
                accept_length=2.4, slo_met=True, worker="http://127.0.0.1:30001", prompt_text=PROMPT, completion_text=COMPLETION)
    return RequestRecord(**{**base, **kw})


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@pytest.fixture
def stream() -> io.StringIO:
    buffer = io.StringIO()
    configure_logging(json=True, stream=buffer)
    return buffer


def test_one_json_line_per_request_with_its_fields_and_no_text(stream):
    Telemetry(POLICY).observe(_record())
    (line,) = [entry for entry in _lines(stream) if entry["event"] == "request"]
    expected = {"request_id": "req-42", "route": "ide", "slice": "code", "rule": "code-ngram", "pool": "ngram",
                "proposer": "ngram", "k": 4, "explored": False, "exploration": None, "status": "ok", "http_status": 200,
                "prompt_tokens": 17,
                "completion_tokens": 12, "ttft_ms": 123.4, "tpot_ms": 21.0, "tpot_source": "stream", "e2e_ms": 354.4,
                "accept_length": 2.4,
                "verify_ct": 5, "slo_met": True, "level": "info"}
    assert {k: line[k] for k in expected} == expected
    assert "prompt_text" not in line and "completion_text" not in line
    assert PROMPT not in stream.getvalue() and COMPLETION not in stream.getvalue()


def test_debug_text_flag_logs_prompt_and_completion(stream):
    Telemetry(POLICY, debug_text=True).observe(_record())
    (line,) = _lines(stream)[-1:]
    assert (line["prompt_text"], line["completion_text"]) == (PROMPT, COMPLETION)
    assert "debug_text" not in line


def test_errors_carry_their_cause_and_keys_never_appear(stream):
    telemetry = Telemetry(POLICY, debug_text=True)
    telemetry.observe(_record(status="upstream_error", http_status=502, error_type="upstream_error",
                              error_message=f"worker said: invalid header Authorization: Bearer {KEY}",
                              prompt_text=f"my key is {KEY}", ttft_s=None, tpot_s=None))
    telemetry.logger.warning("client_rejected", detail=f"api_key={KEY}", header=f"Bearer {KEY}")
    telemetry.set_policy(POLICY, version="v1", reload_ok=False, error="rules[0].then: unknown pool 'x'")
    lines = _lines(stream)
    request = next(entry for entry in lines if entry["event"] == "request")
    assert request["level"] == "error" and request["error"] == "upstream_error"
    assert request["cause"] == "worker said: invalid header [redacted] [redacted]"
    assert request["prompt_text"] == "my key is [redacted]"
    reload = next(entry for entry in lines if entry["event"] == "policy_reload_failed")
    assert (reload["level"], reload["cause"]) == ("error", "rules[0].then: unknown pool 'x'")
    assert KEY not in stream.getvalue() and "Zq8vR2mX4nT7kL1pW9sB3dF6gH0jA5cE" not in stream.getvalue()
    assert stream.getvalue().count("[redacted]") == 5


def test_client_side_outcomes_log_as_warning_and_level_filters(stream):
    configure_logging(json=True, level="warning", stream=stream)
    telemetry = Telemetry(POLICY)
    telemetry.observe(_record(request_id="ok-one"))
    telemetry.observe(_record(request_id="limited", status="rate_limited", http_status=429,
                              error_type="rate_limited", error_message="route ide: 2 requests/s"))
    assert [(e["request_id"], e["level"], e["cause"]) for e in _lines(stream)] == [
        ("limited", "warning", "route ide: 2 requests/s")]


def test_console_output_is_readable_key_value_lines():
    stream = io.StringIO()
    configure_logging(json=False, stream=stream)
    Telemetry(POLICY).observe(_record())
    text = stream.getvalue()
    assert "request" in text and "request_id=req-42" in text and "route=ide" in text and "ttft_ms=123.4" in text
    assert "\x1b[" not in text, "no colour codes when writing to a non-terminal"
    assert PROMPT not in text


def test_bad_level_names_the_fix():
    with pytest.raises(ValueError, match=r"log level 'verbose' is not one of debug, info, warning, error, critical"):
        configure_logging(json=True, level="verbose")


@pytest.mark.parametrize("text", [f"Bearer {KEY}", KEY, "x-api-key: abc123def", 'token="hunter2hunter2"'])
def test_mask_secrets(text):
    assert "[redacted]" in mask_secrets(text) and text.split()[-1].strip('"') not in mask_secrets(text)
