"""`specgate up --policy FILE`: what `make serve` runs. Starts the embedded worker(s) the policy names
on loopback addresses (`specgate worker --port P`), waits until each answers /health, then runs the
gateway (`specgate serve`) on 127.0.0.1:8000; Ctrl-C or SIGTERM stops everything.

``--workers N`` runs N embedded workers on consecutive ports from the policy's one loopback worker
URL, and serves a derived copy of the policy (written next to the logs) listing all N in every pool
that listed that URL. Worker URLs on other hosts are left to whoever runs them.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from policies.errors import PolicyError

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_CLI = "import sys; from cli import main; sys.exit(main())"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start the embedded worker(s) and the gateway (make serve)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="deploy/policies/default.yaml", help="policy YAML file")
    p.add_argument("--workers", type=int, default=None,
                   help="run N embedded workers from the policy's loopback worker port upward")
    p.add_argument("--host", default="127.0.0.1", help="gateway address")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra flag for every `specgate worker` (repeatable, e.g. --worker-arg=--no-calibrate)")
    p.add_argument("--log-dir", type=Path, default=None, help="where worker logs go (default: a temp dir)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for workers")
    p.set_defaults(func=_run)


def local_worker_urls(policy: object) -> list[str]:
    urls = dict.fromkeys(url for pool in policy.pools.values() for url in pool.workers)  # type: ignore[attr-defined]
    return [u for u in urls if urlsplit(u).hostname in _LOOPBACK]


def derive_policy(text: str, url: str, count: int) -> tuple[str, list[str]]:
    """The policy text with ``url`` replaced by ``count`` URLs on consecutive ports."""
    parts = urlsplit(url)
    port = parts.port or 30000
    urls = [f"{parts.scheme}://{parts.hostname}:{port + i}" for i in range(count)]
    return text.replace(f'"{url}"', ", ".join(f'"{u}"' for u in urls)), urls


def _wait_healthy(url: str, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker for {url} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"worker {url} not healthy in time")


def _run(args: argparse.Namespace) -> int:
    from policies.load import load_policy_file  # about 20 ms: specgate --help reads no policy

    try:
        policy = load_policy_file(args.policy)
    except PolicyError as exc:
        print("error: invalid policy:\n" + "\n".join(exc.errors), file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="specgate-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    policy_path, urls = Path(args.policy), local_worker_urls(policy)
    if args.workers is not None:
        if len(urls) != 1:
            print(f"error: --workers needs exactly one loopback worker URL in the policy, found {urls}",
                  file=sys.stderr)
            return 2
        text, urls = derive_policy(policy_path.read_text(encoding="utf-8"), urls[0], args.workers)
        policy_path = log_dir / "policy.yaml"
        policy_path.write_text(text, encoding="utf-8")
        print(f"serving derived policy {policy_path} ({args.workers} workers)")
    procs: list[subprocess.Popen] = []
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        deadline = time.monotonic() + args.startup_timeout
        for url in urls:
            port = str(urlsplit(url).port or 30000)
            log = (log_dir / f"worker-{port}.log").open("wb")
            procs.append(subprocess.Popen([sys.executable, "-c", _CLI, "worker", "--port", port,
                                           *args.worker_arg], stdout=log, stderr=subprocess.STDOUT))
            print(f"worker {url} starting (log {log.name} in {log_dir})")
        for url, proc in zip(urls, procs):
            _wait_healthy(url, proc, deadline)
            print(f"worker {url} healthy")
        procs.append(subprocess.Popen([sys.executable, "-c", _CLI, "serve", "--policy", str(policy_path),
                                       "--host", args.host, "--port", str(args.port), "--log-console"]))
        print(f"gateway on http://{args.host}:{args.port} (Ctrl-C stops everything)")
        while not stopping and all(p.poll() is None for p in procs):
            time.sleep(0.3)
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        stopping = False
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0 if stopping else 1
