"""The exporter process's HTTP transport (telemetry/otel_export.span_exporter): the SDK's urllib3 transport where
it sends what the SDK's default, requests, would, and requests wherever a proxy, a netrc entry, a CA bundle
directory or a credential provider applies; a CA bundle variable of requests' own is given to urllib3. Sending through either to a real receiver:
tests/integration/test_otel_pipe.py."""

from __future__ import annotations

import pytest
import requests.utils
from opentelemetry.exporter.http.transport._requests import RequestsHTTPTransport
from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport

from telemetry.otel_export import span_exporter

ENDPOINT = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://collector.example:4318/v1/traces"}


def _transport(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy",
                 "no_proxy", "NETRC", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "OTEL_EXPORTER_OTLP_CERTIFICATE",
                 "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "OTEL_EXPORTER_OTLP_CLIENT_KEY",
                 "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent/netrc")  # this machine's own ~/.netrc, if any, stays out of it
    for name, value in {**ENDPOINT, **env}.items():
        monkeypatch.setenv(name, value)
    exporter = span_exporter({**ENDPOINT, **env})
    try:
        return exporter._client._transport
    finally:
        exporter.shutdown()


def test_a_plain_environment_sends_on_urllib3_with_requests_ca_bundle(monkeypatch):
    transport = _transport(monkeypatch, {})
    assert type(transport) is Urllib3HTTPTransport
    kw = transport._pool.connection_pool_kw
    assert (kw["cert_reqs"], kw["ca_certs"]) == ("CERT_REQUIRED", requests.utils.DEFAULT_CA_BUNDLE_PATH)


def test_the_sdks_tls_files_carry_over(monkeypatch, tmp_path):
    ca, cert, key = (tmp_path / name for name in ("ca.pem", "client.pem", "client.key"))
    transport = _transport(monkeypatch, {"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(ca),
                                         "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(cert),
                                         "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(key)})
    kw = transport._pool.connection_pool_kw
    assert (kw["ca_certs"], kw["cert_file"], kw["key_file"]) == (str(ca), str(cert), str(key))


@pytest.mark.parametrize("env", [
    {"REQUESTS_CA_BUNDLE": "requests.pem"},
    {"CURL_CA_BUNDLE": "curl.pem"},
    {"REQUESTS_CA_BUNDLE": "requests.pem", "CURL_CA_BUNDLE": "curl.pem"},
    {"REQUESTS_CA_BUNDLE": "", "CURL_CA_BUNDLE": "curl.pem"},
    {"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": "otel.pem", "REQUESTS_CA_BUNDLE": "requests.pem"},
    {"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": "otel.pem"},
], ids=["requests", "curl", "both", "empty-requests", "otel-and-requests", "otel"])
def test_urllib3_verifies_with_the_ca_bundle_requests_would(monkeypatch, tmp_path, env):
    """requests lets its own variables replace the SDK's certificate file (merge_environment_settings); urllib3 is
    given the file requests itself resolves for the same environment and session."""
    env = {name: str(tmp_path / value) if value else "" for name, value in env.items()}
    transport = _transport(monkeypatch, env)
    assert type(transport) is Urllib3HTTPTransport
    session = requests.Session()
    session.verify = env.get("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", True)  # as the SDK sets its session's
    verify = session.merge_environment_settings(ENDPOINT["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"], {}, None, None,
                                                None)["verify"]
    assert transport._pool.connection_pool_kw["ca_certs"] == verify != requests.utils.DEFAULT_CA_BUNDLE_PATH


@pytest.mark.parametrize("env", [
    {"HTTPS_PROXY": "http://proxy.example:3128"},
    {"REQUESTS_CA_BUNDLE": "DIR"},
], ids=["proxy", "ca-directory"])
def test_requests_stays_where_its_extras_apply(monkeypatch, tmp_path, env):
    env = {name: str(tmp_path) if value == "DIR" else value for name, value in env.items()}
    assert type(_transport(monkeypatch, env)) is RequestsHTTPTransport


def test_a_credential_provider_keeps_requests(monkeypatch):
    """Named in the variables given (the SDK itself, which would load the provider's session from an entry point,
    reads the process's, which here lack it)."""
    _transport(monkeypatch, {})
    exporter = span_exporter({**ENDPOINT, "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER": "vendor"})
    try:
        assert type(exporter._client._transport) is RequestsHTTPTransport
    finally:
        exporter.shutdown()


def test_a_proxy_the_endpoint_is_exempt_from_keeps_urllib3(monkeypatch):
    transport = _transport(monkeypatch, {"HTTPS_PROXY": "http://proxy.example:3128", "NO_PROXY": "collector.example"})
    assert type(transport) is Urllib3HTTPTransport


def test_a_netrc_entry_for_the_collector_keeps_requests(monkeypatch, tmp_path):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine collector.example login ops password secret\n")
    netrc.chmod(0o600)
    transport = _transport(monkeypatch, {})
    assert type(transport) is Urllib3HTTPTransport
    monkeypatch.setenv("NETRC", str(netrc))
    exporter = span_exporter(ENDPOINT)
    try:
        assert type(exporter._client._transport) is RequestsHTTPTransport
    finally:
        exporter.shutdown()
