"""A gateway in front of two real `specgate worker` processes, and the clients that load it.

Shared by the short reliability tests (``tests/reliability``) and the full run (``bench/reliability``).
Workers live on fixed ports for the whole run so one can be killed (``kill -9``) and restarted on the
same port: the gateway's policy keeps naming it and must take it back once it is healthy.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from bench.processes import BIN, MODEL, REPO, free_port, stop, wait_http


def policy_yaml(*, plain: list[str], ngram: list[str], revision: str, routes: str = "",
                rules: str = "", max_resumes: int | None = None) -> str:
    """Two per-request pools; ``code`` prompts are pinned to ngram (k=4) so the ngram pool's
    fallback is observable; everything else is served plain unless ``rules`` says otherwise.
    ``max_resumes``: the policy's ``resume.max_resumes`` (None: its default; 0: streams are not resumed)."""
    def urls(ws: list[str]) -> str:
        return ", ".join(f'"{u}"' for u in ws)
    resume = "" if max_resumes is None else f"resume: {{max_resumes: {max_resumes}}}\n"
    return resume + f"""version: 1
slo: {{ttft_ms: 5000, tpot_ms: 500}}
{routes}
slices:
  - {{name: code, when: {{code_score: {{gte: 0.3}}}}}}
  - {{name: prose}}
pairs:
  smollm2-ngram:
    target: {{model: {MODEL}, revision: "{revision}"}}
    draft: {{kind: ngram}}
pools:
  plain: {{proposer: none, workers: [{urls(plain)}], speculation: per_request}}
  ngram: {{proposer: ngram, draft_tokens: {{min: 1, max: 8}}, pair: smollm2-ngram, workers: [{urls(ngram)}], speculation: per_request}}
rules:
  - {{name: unverified-pair, when: {{pair_verified: false}}, then: bypass}}
{rules}  - {{name: code-ngram, when: {{slice: code}}, then: {{pool: ngram, draft_tokens: 4}}}}
  - {{name: prose-plain, then: bypass}}
learning: {{half_life_s: 600}}
"""


@dataclass
class Workers:
    """``n`` real workers on fixed free ports; ``kill`` (SIGKILL) and ``restart`` one by index."""

    tmp: Path
    n: int = 2
    flags: tuple[str, ...] = ("--max-running-requests", "4", "--num-threads", "1")
    ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen | None] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def start(self) -> Workers:
        self.ports = [free_port() for _ in range(self.n)]
        self.procs = [self._spawn(i) for i in range(self.n)]
        for i, proc in enumerate(self.procs):
            wait_http(f"{self.urls[i]}/health", proc)
        return self

    def _spawn(self, i: int) -> subprocess.Popen:
        argv = [str(BIN / "specgate"), "worker", "--port", str(self.ports[i]), "--no-calibrate",
                "--log-level", "warning", *self.flags]
        log = (self.tmp / f"worker-{self.ports[i]}.log").open("ab")
        env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def restart(self, i: int, wait: bool = True) -> None:
        self.procs[i] = self._spawn(i)
        if wait:
            wait_http(f"{self.urls[i]}/health", self.procs[i])

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None and p.poll() is None]

    def close(self) -> None:
        for proc in self.procs:
            if proc is not None:
                stop(proc)


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def listener_pid(url: str) -> int:
    port = int(url.rsplit(":", 1)[1])
    return next(c.pid for c in psutil.net_connections("tcp")
                if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN)


def worker_load(url: str) -> tuple[int, float]:
    """(running requests, KV token usage) from the worker's ``/v1/loads``."""
    rank = httpx.get(f"{url}/v1/loads", timeout=5).json()["loads"][0]
    return rank["num_running_reqs"], rank["token_usage"]


def seconds_per_token(url: str, tokens: int = 16) -> float:
    """Wall time per generated token of one short greedy, plain (non-speculative) ``/generate`` on
    the worker at ``url``: the unit in which tests bound how fast an abort frees it, so the bound
    scales with the machine. Prefill and the HTTP round trip are included, so this overstates one
    decode step (the bounds err generous)."""
    body = {"text": "Once upon a time", "sampling_params": {
        "max_new_tokens": tokens, "temperature": 0, "ignore_eos": True,
        "custom_params": {"speculation": {"proposer": "none"}}}}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    assert r.json()["meta_info"]["completion_tokens"] == tokens, r.text[:300]
    return elapsed / tokens


def chat_body(prompt: str, max_tokens: int, *, stream: bool = True, **extra: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra}


def expected_texts(worker: str, prompts: list[str], max_tokens: int) -> list[str]:
    """The plain (non-speculative, one request at a time) greedy answer of each prompt."""
    out = []
    for prompt in prompts:
        body = chat_body(prompt, max_tokens, stream=False,
                         custom_params={"speculation": {"proposer": "none"}})
        r = httpx.post(f"{worker}/v1/chat/completions", json=body, timeout=120)
        r.raise_for_status()
        out.append(r.json()["choices"][0]["message"]["content"])
    return out


@dataclass
class StreamResult:
    """What one streaming client saw: HTTP status, the concatenated text, an error event if any,
    whether ``[DONE]`` arrived, the distinct completion ids, and the final ``specgate`` object."""

    status: int
    text: str = ""
    error: dict | None = None
    done: bool = False
    ids: set[str] = field(default_factory=set)
    info: dict | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    seconds: float = 0.0

    @property
    def clean_error(self) -> bool:
        """An OpenAI-style error: a non-200 JSON error body, or an error event then ``[DONE]``."""
        if self.status != 200:
            try:
                error = json.loads(self.body)["error"]
            except (ValueError, KeyError, TypeError):
                return False
            return isinstance(error, dict) and {"message", "type"} <= set(error)
        return self.error is not None and self.done and {"message", "type"} <= set(self.error)


async def stream_chat(http: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None,
                      *, stop_after: int | None = None) -> StreamResult:
    """POST a streaming chat request and read it to the end (or close after ``stop_after`` chunks)."""
    t0 = time.perf_counter()
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        res = StreamResult(status=r.status_code, headers=dict(r.headers))
        if r.status_code != 200:
            res.body = await r.aread()
            res.seconds = time.perf_counter() - t0
            return res
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                res.done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                res.error = obj["error"]
                continue
            res.ids.add(obj["id"])
            for choice in obj.get("choices") or ():
                res.text += choice["delta"].get("content") or ""
            res.info = obj.get("specgate", res.info)
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                break
    res.seconds = time.perf_counter() - t0
    return res


async def wait_until(predicate, timeout: float, interval: float = 0.05) -> float:
    """Seconds until ``predicate()`` held; raises after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")
