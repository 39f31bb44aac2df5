"""Reliability scenarios as async drivers returning reports: the short tests assert on them and
``bench.reliability`` runs them at full size. Each takes a running gateway URL (and the workers)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx

from bench.processes import ADMIN
from gateway.reload import content_version
from bench.reliability.cluster import (
    Workers, chat_body, expected_texts, policy_yaml, stream_chat, wait_until, worker_load)

PROSE = [f"In one short sentence, describe the colour of {thing}." for thing in
         ("the sky", "grass", "snow", "a banana", "coal", "a tomato", "the sea", "sand")]
CODE = [f"def f{i}(a, b):\n    return a + b * {i}\n\ndef g{i}(a, b):\n    return a - b\n\n# write h{i}(a, b) like above\n"
        for i in range(4)]
PROMPTS = PROSE + CODE


def _timeout(s: float = 180.0) -> httpx.Timeout:
    return httpx.Timeout(s, connect=10.0)


@dataclass
class SoakReport:
    requests: int = 0
    exact: int = 0
    clean_errors: int = 0
    lost: int = 0  # neither exact nor a clean error (wrong text, silence, a hang)
    mixed: int = 0  # the text is another prompt's answer or a stream carried two completion ids
    seconds: float = 0.0
    pools: Counter = field(default_factory=Counter)


async def soak(gw: str, plain_worker: str, *, clients: int, requests: int, max_tokens: int,
               duration_s: float | None = None) -> SoakReport:
    """``clients`` concurrent streaming clients share ``requests`` greedy requests (or run until
    ``duration_s``); each answer is compared with the prompt's plain greedy answer."""
    expected = expected_texts(plain_worker, PROMPTS, max_tokens)
    report = SoakReport()
    next_index = iter(range(10**9))
    t0 = time.monotonic()

    def more() -> int | None:
        i = next(next_index)
        if duration_s is not None:
            return i if time.monotonic() - t0 < duration_s else None
        return i if i < requests else None

    async def client(http: httpx.AsyncClient) -> None:
        while (i := more()) is not None:
            p = i % len(PROMPTS)
            try:
                res = await stream_chat(http, gw, chat_body(PROMPTS[p], max_tokens))
            except httpx.HTTPError:
                report.requests += 1
                report.lost += 1
                continue
            report.requests += 1
            if res.info:
                report.pools[res.info["pool"]] += 1
            if res.status == 200 and res.done and res.error is None and res.text == expected[p] \
                    and len(res.ids) == 1:
                report.exact += 1
            elif res.clean_error:
                report.clean_errors += 1
            else:
                report.lost += 1
                if len(res.ids) > 1 or (res.text in expected and res.text != expected[p]):
                    report.mixed += 1

    async with httpx.AsyncClient(timeout=_timeout(), limits=httpx.Limits(max_connections=None)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    report.seconds = round(time.monotonic() - t0, 1)
    return report


async def disconnects(gw: str, workers: list[str], *, clients: int) -> float:
    """``clients`` streams that close after 3 chunks; seconds from the last close until every worker
    runs nothing and its KV usage is back to where it was before."""
    baseline = {w: worker_load(w) for w in workers}
    body = chat_body("Tell a very long story about a lighthouse.", 400, ignore_eos=True)
    async with httpx.AsyncClient(timeout=_timeout()) as http:
        results = await asyncio.gather(*(stream_chat(http, gw, body, stop_after=3) for _ in range(clients)))
    closed = time.monotonic()
    assert all(r.status == 200 and not r.done for r in results), "a stream was not cut mid-way"

    def idle() -> bool:
        return all(worker_load(w)[0] == 0 and worker_load(w)[1] <= baseline[w][1] for w in workers)

    await wait_until(idle, timeout=120.0)  # a deadline for a broken abort, not the figure
    return time.monotonic() - closed


# Route ``noisy`` may have 2 requests in flight; ``metered`` refills one request per 100 s (burst 2),
# so a burst of 10 admits exactly 2 however long the burst takes to send.
NOISY_CAP = 2
OVERLOAD_ROUTES = f"""routes:
  - {{name: noisy, api_keys_env: REL_KEYS_NOISY, max_concurrency: {NOISY_CAP}}}
  - {{name: metered, api_keys_env: REL_KEYS_METERED, rate_limit: {{requests_per_s: 0.01, burst: 2}}}}
  - {{name: quiet, api_keys_env: REL_KEYS_QUIET}}"""
OVERLOAD_KEYS = {f"REL_KEYS_{name.upper()}": f"{name}-key-1" for name in ("noisy", "metered", "quiet")}


@dataclass
class OverloadReport:
    noisy_status: Counter = field(default_factory=Counter)
    metered_status: Counter = field(default_factory=Counter)
    quiet_status: Counter = field(default_factory=Counter)
    retry_after_ok: bool = True
    hung: int = 0
    quiet_alone_s: list[float] = field(default_factory=list)
    quiet_under_load_s: list[float] = field(default_factory=list)


async def overload(gw: str, *, noisy: int, quiet: int, hold_tokens: int = 400) -> OverloadReport:
    """Route ``quiet`` times ``quiet`` requests alone. Route ``noisy`` (max_concurrency 2) then opens 2
    long streams (``hold_tokens``, ignore_eos) and keeps them open, so its slots are taken whatever the
    machine's speed, and fires ``noisy - 2`` more at once; while the 2 still generate, ``quiet`` times
    ``quiet`` requests again; then the 2 are closed. Route ``metered`` fires 10 at once last."""
    report = OverloadReport()
    auth = {name: {"authorization": f"Bearer {name}-key-1"} for name in ("noisy", "metered", "quiet")}

    def check_429(res) -> None:
        if res.status == 429:
            report.retry_after_ok &= res.headers.get("retry-after", "").isdigit() and res.clean_error

    async with httpx.AsyncClient(timeout=_timeout(120)) as http:
        async def one(route: str, tokens: int):
            try:
                return await stream_chat(http, gw, chat_body(PROSE[1], tokens), auth[route])
            except httpx.TimeoutException:
                report.hung += 1
                return None

        async def quiet_run(times: list[float], status: Counter) -> None:
            for _ in range(quiet):
                res = await one("quiet", 4)
                if res is not None:
                    status[res.status] += 1
                    times.append(res.seconds)

        await quiet_run(report.quiet_alone_s, Counter())
        async with contextlib.AsyncExitStack() as held:
            long_body = chat_body(PROSE[0], hold_tokens, ignore_eos=True)
            for _ in range(NOISY_CAP):  # response headers: admitted, in flight until closed
                r = await held.enter_async_context(
                    http.stream("POST", f"{gw}/v1/chat/completions", json=long_body, headers=auth["noisy"]))
                report.noisy_status[r.status_code] += 1
            probes = await asyncio.gather(*(one("noisy", 4) for _ in range(noisy - NOISY_CAP)))
            for res in probes:
                if res is not None:
                    report.noisy_status[res.status] += 1
                    check_429(res)
            await quiet_run(report.quiet_under_load_s, report.quiet_status)
        # leaving the stack closed the held streams: the gateway aborts them

        metered = await asyncio.gather(*(one("metered", 1) for _ in range(10)))
        for res in metered:
            if res is not None:
                report.metered_status[res.status] += 1
                check_429(res)
    return report


@dataclass
class ReloadReport:
    requests: int = 0
    failed: int = 0
    invalid_written: int = 0
    rejections_reported: int = 0  # invalid versions /admin/policy reported rejected, with the error
    rules_seen: Counter = field(default_factory=Counter)  # rule -> traffic requests it decided
    # after each edit took effect: (the rule the last good version has, the rule that decided a probe)
    probes: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def reloaded_rules_seen(self) -> set[str]:
        """Rules only a reloaded valid version has (``valid-N``) that decided traffic."""
        return {rule for rule in self.rules_seen if rule.startswith("valid-")}

    @property
    def invalid_rules_seen(self) -> set[str]:
        return {rule for rule in self.rules_seen if rule.startswith("invalid-")}


async def reloads(gw: str, path: Path, workers: list[str], revision: str, *, rounds: int,
                  clients: int = 2) -> ReloadReport:
    """Traffic runs while the file goes through ``rounds`` pairs: a valid version (rule ``valid-N``,
    which neither the startup file nor any other version has), then an invalid one (rule ``invalid-N``
    pointing at an unknown pool). Each edit waits until /admin/policy shows it took effect (the new
    version in force, or the rejection with its error), sends a probe, and lets ``clients`` traffic
    requests finish before the next edit, so every version serves traffic however slow the machine.
    Every request must succeed, ``valid-N`` must decide the probes of both halves of round N (the last
    good version, not the startup one, survives a rejection), and no ``invalid-*`` rule may serve."""
    report = ReloadReport()
    stop = asyncio.Event()
    body = chat_body(PROSE[2], 4, stream=False)

    def version(name: str, pool: str) -> str:
        rule = f"  - {{name: {name}, when: {{slice: prose}}, then: {{pool: {pool}, draft_tokens: 2}}}}\n"
        return policy_yaml(plain=workers, ngram=workers, revision=revision, rules=rule)

    async def traffic(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            r = await http.post(f"{gw}/v1/chat/completions", json=body)
            report.requests += 1
            if r.status_code != 200:
                report.failed += 1
                report.errors.append(r.text[:200])
                continue
            report.rules_seen[r.headers["x-specgate-rule"]] += 1

    async def until(predicate, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=_timeout(30)) as a:
            while time.monotonic() < deadline:
                if predicate((await a.get(f"{gw}/admin/policy", headers=ADMIN)).json()):
                    return True
                await asyncio.sleep(0.1)
        return False

    def rejected(bad: str, status: dict) -> bool:
        last = status["last_reload"]
        return last["version"] == bad and last["ok"] is False and any("nowhere" in e for e in last["errors"])

    async def edits(http: httpx.AsyncClient) -> None:
        try:
            for n in range(rounds):
                valid, invalid = version(f"valid-{n}", "ngram"), version(f"invalid-{n}", "nowhere")
                good, bad = content_version(valid.encode()), content_version(invalid.encode())
                path.write_text(valid, encoding="utf-8")
                await until(lambda s: s["version"] == good and s["last_reload"]["ok"])
                await probe_then_traffic(http, f"valid-{n}")
                path.write_text(invalid, encoding="utf-8")
                report.invalid_written += 1
                report.rejections_reported += await until(partial(rejected, bad))
                await probe_then_traffic(http, f"valid-{n}")
        finally:
            stop.set()

    async def probe_then_traffic(http: httpx.AsyncClient, expected: str) -> None:
        r = await http.post(f"{gw}/v1/chat/completions", json=body)
        report.probes.append((expected, r.headers.get("x-specgate-rule", f"HTTP {r.status_code}")))
        done = report.requests
        deadline = time.monotonic() + 120
        while report.requests < done + clients and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=_timeout(120)) as http:
        await asyncio.gather(edits(http), *(traffic(http) for _ in range(clients)))
    return report


@dataclass
class FaultReport:
    inflight: int = 0
    inflight_ok: int = 0
    inflight_errors: int = 0  # streams on the killed worker ended with an error event + [DONE]
    inflight_resumed: int = 0  # streams another worker continued after the kill (gateway/resume.py)
    resumed_exact: int = 0  # of those, the text equals the prompt's uninterrupted greedy answer
    silent: int = 0  # a stream that ended without [DONE] or a non-200 without the error shape
    after: int = 0
    after_ok: int = 0
    retried: int = 0
    fallback_pool: str | None = None
    fallback_flag: bool | None = None
    fallback_reason: str | None = None
    ejected: bool = False
    readmitted_after_s: float | None = None


async def kill_worker(gw: str, workers: Workers, index: int, *, in_flight: int, after: int) -> FaultReport:
    """Start ``in_flight`` long streams (half code, pinned to the ngram pool on the doomed worker),
    kill -9 worker ``index`` once it runs some, send ``after`` more requests, check ejection and the
    ngram pool's fallback, restart the worker on its port and time until the pool takes it back."""
    report = FaultReport(inflight=in_flight, after=after)
    doomed = workers.urls[index]
    # the surviving worker now also finishes the resumed streams, so a new request may queue behind them
    async with httpx.AsyncClient(timeout=_timeout(600)) as http:
        def body(i: int, tokens: int) -> dict:
            return chat_body((CODE if i % 2 else PROSE)[i % 4], tokens, ignore_eos=True)

        running = [asyncio.create_task(stream_chat(http, gw, body(i, 200))) for i in range(in_flight)]
        await wait_until(lambda: worker_load(doomed)[0] >= 1, timeout=60)
        await asyncio.sleep(0.3)
        workers.kill(index)
        later = await asyncio.gather(*(stream_chat(http, gw, body(i, 4)) for i in range(after)))
        first = await asyncio.wait_for(asyncio.gather(*running), timeout=600)
        resumed = [(i, res) for i, res in enumerate(first) if res.info and res.info.get("resumed")
                   and res.info["resumed"]["count"]]
        report.inflight_resumed = len(resumed)
        if resumed:  # each resumed stream's text against its uninterrupted answer, on the surviving worker
            survivor = workers.urls[1 - index]
            for i, res in resumed:
                plain = {**body(i, 200), "stream": False, "custom_params": {"speculation": {"proposer": "none"}}}
                r = await http.post(f"{survivor}/v1/chat/completions", json=plain)
                report.resumed_exact += r.json()["choices"][0]["message"]["content"] == res.text
        for res in first:
            if res.status == 200 and res.done and res.error is None:
                report.inflight_ok += 1
            elif res.clean_error:
                report.inflight_errors += 1
            else:
                report.silent += 1
        for res in later:
            report.after_ok += res.status == 200 and res.done and res.error is None
            report.silent += not (res.done or res.clean_error)
            report.retried += bool(res.info and res.info["retries"])
        pools = (await http.get(f"{gw}/admin/pools", headers=ADMIN)).json()
        state = next(w for w in pools["ngram"]["workers"] if w["url"] == doomed)
        report.ejected = not state["healthy"] or state["ejected"]
        r = await http.post(f"{gw}/v1/chat/completions", json=chat_body(CODE[0], 4, stream=False))
        info = r.json()["specgate"]
        report.fallback_pool, report.fallback_flag, report.fallback_reason = \
            info["pool"], info["fallback"], info["reason"]
        workers.restart(index, wait=False)
        t0 = time.monotonic()

        async def healthy() -> bool:
            pools = (await http.get(f"{gw}/admin/pools", headers=ADMIN)).json()
            return any(w["url"] == doomed and w["healthy"] and not w["ejected"]
                       for w in pools["ngram"]["workers"])

        while time.monotonic() - t0 < 150:
            if await healthy():
                report.readmitted_after_s = round(time.monotonic() - t0, 1)
                break
            await asyncio.sleep(0.5)
    return report
