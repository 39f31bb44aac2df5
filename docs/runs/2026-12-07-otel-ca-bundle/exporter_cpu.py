"""The trace exporter process's CPU per gateway request, end to end: N recorded requests' frames piped into
``python -m telemetry.otel_export`` started from each checkout given, sending to bench/otlp_sink.py, with this
process's environment (so REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE, where set, apply as in a gateway). The exporter's
user + system CPU from wait4, start-up (its imports) subtracted by a run with no frames. Checkouts interleaved.

    .venv/bin/python docs/runs/2026-12-07-otel-ca-bundle/exporter_cpu.py CHECKOUT [CHECKOUT ...]   # from the root
"""
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
PORT, N = 43188, 20000
REPEATS = int(os.environ.get("REPEATS", "3"))

from bench.otel_spans import _Buffered, _request, _tracing, served_request  # noqa: E402


def frames(n: int) -> bytes:
    finished, record = served_request()
    pipe = _Buffered(keep=True)
    tracing = _tracing(1.0, pipe)
    for _ in range(n):
        _request(tracing, finished, record)
    return bytes(pipe._buf)


def cpu_of(checkout: str, data: bytes) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": checkout, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{PORT}/v1/traces",
           "SPECGATE_OTEL_EXPORTER_PRIORITY": "normal"}
    p = subprocess.Popen([sys.executable, "-m", "telemetry.otel_export", "bench"], stdin=subprocess.PIPE, cwd=checkout,
                         env=env)
    p.stdin.write(data)
    p.stdin.close()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def transport(checkout: str) -> str:
    code = ("import os; from telemetry.otel_export import span_exporter; "
            "print(type(span_exporter(os.environ)._client._transport).__name__)")
    env = {**os.environ, "PYTHONPATH": checkout, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{PORT}/v1/traces"}
    return subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def main() -> None:
    checkouts = sys.argv[1:]
    sink = subprocess.Popen([sys.executable, "-m", "bench.otlp_sink", "--port", str(PORT)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2.5)
    try:
        data = frames(N)
        print("CA bundle variables set:", {k: os.environ[k] for k in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
                                            if k in os.environ})
        for c in checkouts:
            print(f"{c}: transport {transport(c)}")
        print(f"exporter CPU us per request ({N} requests, start-up subtracted), per repeat:")
        for _ in range(REPEATS):
            row = []
            for c in checkouts:
                row.append((cpu_of(c, data) - cpu_of(c, b"")) / N * 1e6)
            print("  " + " | ".join(f"{c}: {v:.1f}" for c, v in zip(checkouts, row)))
    finally:
        sink.terminate()


if __name__ == "__main__":
    main()
