"""Security: admin token, constant-time key checks, no keys or text in logs/metrics/errors, body
limit before parsing, no public bind without keys, client input never a metric label."""

from __future__ import annotations

import hmac
import subprocess

import httpx
import pytest

from gateway import auth
from bench.processes import ADMIN_TOKEN, BIN, MODEL, REPO, gateway, write_policy
from bench.reliability.cluster import policy_yaml

pytestmark = [pytest.mark.integration, pytest.mark.real_model, pytest.mark.timeout(300)]
KEYS = {"REL_SEC_KEYS_APP": "sk-reliability-app-0123456789", "REL_SEC_KEYS_OPS": "ops-secret-key-42"}
ROUTES = """routes:
  - {name: app, api_keys_env: REL_SEC_KEYS_APP}
  - {name: ops, api_keys_env: REL_SEC_KEYS_OPS}"""
SECRET_PROMPT = "zanzibarquokka"  # a word the model never says on its own
WRONG_KEY = "sk-wrong-but-plausible-987654321"


@pytest.fixture(scope="module")
def secured(tmp_path_factory, cluster_workers, revision):
    tmp = tmp_path_factory.mktemp("security")
    urls = cluster_workers.urls
    policy = write_policy(tmp / "policy.yaml", policy_yaml(plain=urls, ngram=urls, revision=revision,
                                                           routes=ROUTES))
    with gateway(tmp, policy, "--log-level", "debug", "--max-body-bytes", "20000", env=KEYS) as url:
        yield url, tmp


def _log_text(tmp) -> str:
    return "\n".join(p.read_text(errors="replace") for p in tmp.glob("gateway-*.log"))


def test_admin_endpoints_refuse_without_the_admin_token(secured):
    url, _ = secured
    app_key = {"authorization": f"Bearer {KEYS['REL_SEC_KEYS_APP']}"}
    for method, path in (("GET", "/admin/policy"), ("GET", "/admin/pools"), ("GET", "/admin/stats"),
                         ("POST", "/admin/explain")):
        for headers in ({}, {"authorization": "Bearer wrong"}, app_key,
                        {"authorization": ADMIN_TOKEN}):  # right token, no Bearer scheme
            r = httpx.request(method, f"{url}{path}", headers=headers, json={"model": MODEL, "prompt": "x"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token", (path, headers)
    ok = httpx.get(f"{url}/admin/policy", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert ok.status_code == 200


def test_keys_are_compared_in_constant_time(monkeypatch, revision):
    from policies.load import load_policy

    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    text = policy_yaml(plain=["http://127.0.0.1:1"], ngram=["http://127.0.0.1:1"], revision=revision,
                       routes=ROUTES)
    ring = auth.KeyRing(load_policy(text, "p.yaml"), environ=KEYS)
    assert ring.route_for(f"Bearer {KEYS['REL_SEC_KEYS_OPS']}") == "ops"
    assert len(calls) == 2  # every known key compared, no early exit
    with pytest.raises(Exception, match="invalid API key"):
        ring.route_for("Bearer nope")
    assert len(calls) == 4
    assert auth.admin_allowed("tok", "Bearer tok") and len(calls) == 5


def test_keys_and_text_never_in_logs_metrics_or_errors(secured):
    url, tmp = secured
    bodies = []
    for key in (*KEYS.values(), WRONG_KEY):
        for stream in (False, True):
            r = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                           json={"model": MODEL, "stream": stream, "max_tokens": 4, "messages": [
                               {"role": "user", "content": f"Repeat: {SECRET_PROMPT}"}]}, timeout=60)
            bodies.append(r.text)
            assert r.status_code == (401 if key == WRONG_KEY else 200)
    r = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {KEYS['REL_SEC_KEYS_APP']}"},
                   json={"model": MODEL, "max_tokens": "x", "messages": [{"role": "user", "content": SECRET_PROMPT}]})
    assert r.status_code == 400
    bodies.append(r.text)
    metrics = httpx.get(f"{url}/metrics").text
    logs = _log_text(tmp)
    assert "request" in logs  # the per-request lines were captured (debug level)
    for secret in (*KEYS.values(), WRONG_KEY):
        assert secret not in logs and secret not in metrics
        assert not any(secret in b for b in bodies)
    assert SECRET_PROMPT not in logs and SECRET_PROMPT not in metrics


def test_bodies_over_the_limit_are_refused_before_parsing(secured):
    url, _ = secured
    garbage = b"{" * 30000  # not JSON: a parser would answer 400, the limit answers 413 first
    r = httpx.post(f"{url}/v1/chat/completions", content=garbage)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunked():  # no Content-Length: the limit must hold while the body streams in
        for _ in range(30):
            yield b"{" * 1000
    r = httpx.post(f"{url}/v1/chat/completions", content=chunked())
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_client_headers_and_fields_never_become_metric_labels(secured):
    """Requests the gateway serves (the served model, so they pass routing and reach the worker and the
    per-request metrics) carry the marker in headers and free-form fields; an unknown model name is
    answered 404 before it could become a label."""
    url, _ = secured
    key = {"authorization": f"Bearer {KEYS['REL_SEC_KEYS_APP']}"}
    marker = "labelbomb"

    def served() -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
                   if line.startswith("specgate_requests_total{") and 'route="app"' in line
                   and 'status="ok"' in line)

    before = served()
    for i in range(3):
        r = httpx.post(f"{url}/v1/chat/completions", headers={**key, f"x-{marker}-{i}": f"{marker}{i}",
                                                              "user-agent": f"{marker}-agent"},
                       json={"model": MODEL, "user": f"{marker}-user",
                             "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text
        r = httpx.post(f"{url}/v1/completions", headers={**key, "x-specgate-route": f"{marker}"},
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": f"{marker}{i}"}, timeout=60)
        assert r.status_code == 200 and r.headers["x-specgate-route"] == "app", r.text
    r = httpx.post(f"{url}/v1/chat/completions", headers=key, timeout=60,
                   json={"model": f"{marker}-model", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    metrics = httpx.get(f"{url}/metrics").text
    assert served() == before + 6, "the served requests were not counted: the label path was not exercised"
    assert marker not in metrics


def test_public_bind_without_keys_refuses_to_start(tmp_path, revision):
    policy = write_policy(tmp_path / "p.yaml", policy_yaml(plain=["http://127.0.0.1:1"],
                                                          ngram=["http://127.0.0.1:1"], revision=revision))
    proc = subprocess.run([str(BIN / "specgate"), "serve", "--policy", str(policy), "--host", "0.0.0.0",
                           "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "refusing to listen on 0.0.0.0" in proc.stderr
