"""One streaming chat completion through the gateway, as an application sends it, and what it saw.

httpx rather than the ``openai`` client because the harness needs the raw final chunk: the gateway
puts its ``specgate`` object (rule, reason, pool, draft length, accept length) there, and the usage chunk
(``stream_options.include_usage``) gives the exact completion token count. TTFT is the first chunk
that carries content or a tool-call delta; TPOT = (e2e - TTFT) / (completion tokens - 1), the
gateway's own definition, measured here on the client side.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import httpx

from bench.workloads import WorkItem


@dataclass
class Result:
    arm: str
    load: str
    slice: str
    item: str
    start_s: float  # when it was sent, relative to the load point's start
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int | None = None  # the usage's (the model's tokens of the chat-templated prompt)
    text: str = ""
    rule: str | None = None
    reason: str | None = None  # the gateway's decision reason (why this pool and k, or why plain)
    explored: bool | None = None  # the decision explored (the gateway's ``specgate.explored``)
    exploration: str | None = None  # why (``specgate.exploration``: cold|thompson)
    pool: str | None = None
    proposer: str | None = None
    draft_tokens: int | None = None
    gateway_slice: str | None = None
    route: str | None = None  # the gateway's route for it: the arm's own, or its cell's (bench/serve/arms.py)
    fallback: bool | None = None
    verify_rounds: int | None = None
    accept_length: float | None = None
    slo_met: bool | None = None
    rep: int = 0  # which replicate of its cell (``--repeats``): the same requests served again
    workload_slice: str | None = None  # with --mix interleaved (cells of slice "mixed"): the request's own slice

    def as_dict(self) -> dict:
        return asdict(self)


def request_body(item: WorkItem, model: str, max_tokens: int) -> dict:
    return {"model": model, **item.chat_body(), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


def _delta_text(chunk: dict) -> str:
    """Content plus tool-call names/arguments, so tool answers are compared too."""
    out = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content"):
            out.append(delta["content"])
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            out.append(f"<tool {fn.get('name') or ''}>{fn.get('arguments') or ''}")
    return "".join(out)


def _take_info(result: Result, info: dict) -> None:
    result.rule, result.pool, result.proposer = info.get("rule"), info.get("pool"), info.get("proposer")
    result.reason = info.get("reason")
    result.draft_tokens, result.gateway_slice = info.get("draft_tokens"), info.get("slice")
    result.fallback, result.verify_rounds = info.get("fallback"), info.get("verify_rounds")
    result.accept_length, result.explored = info.get("accept_length"), info.get("explored")
    result.exploration = info.get("exploration")
    result.route = info.get("route")


async def send(client: httpx.AsyncClient, url: str, body: dict, result: Result,
               headers: dict[str, str] | None = None) -> Result:
    """Send ``body`` to ``url`` (streaming); fill ``result``. Errors are recorded, not raised."""
    t0 = time.perf_counter()
    pieces: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:300]
                    return result
                text = _delta_text(chunk)
                if text:
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - t0
                    pieces.append(text)
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"].get("completion_tokens") or 0
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens")
                if chunk.get("specgate"):
                    _take_info(result, chunk["specgate"])
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e_s = time.perf_counter() - t0
    result.ttft_s = result.ttft_s if result.ttft_s is not None else result.e2e_s
    if result.completion_tokens >= 2:
        result.tpot_s = (result.e2e_s - result.ttft_s) / (result.completion_tokens - 1)
    result.text = "".join(pieces)
    result.ok = True
    return result


def slo_met(result: Result, ttft_ms: float | None, tpot_ms: float | None) -> bool | None:
    """DistServe's goodput condition: TTFT and TPOT both within the SLO (the gateway's rule)."""
    if not result.ok:
        return False
    met = True
    if ttft_ms is not None and result.ttft_s is not None:
        met = met and result.ttft_s * 1e3 <= ttft_ms
    if tpot_ms is not None and result.tpot_s is not None:
        met = met and result.tpot_s * 1e3 <= tpot_ms
    return met
