"""The request lifecycle: admit (auth, parse, features, checks, limits) -> decide -> dispatch with
retries and the plain fallback -> answer (JSON, or a relayed stream) -> record once (``Call.finish``).

Retry rule (DESIGN.md): a worker failure before the first byte reached our client is retried on
another worker of the decided pool, then on the plain fallback (a pool with proposer none, else the
same per-request workers with speculation off); at most ``max_attempts`` tries in all. A worker's
4xx (the request's own fault) is answered at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from backends.sglang.client import SGLangClient
from backends.sglang.errors import WorkerError, WorkerHTTPError
from gateway.call import Call
from gateway.errors import ApiError, from_worker
from gateway.requests import ChatRequest, CompletionRequest, parse_body
from gateway.state import GatewayState
from policies.decide import decide, exploration_key
from policies.features import features_from_openai

T = TypeVar("T")
DEFAULT_RESERVED_COMPLETION = 256  # tokens reserved against tokens_per_min when max_tokens is absent


def admit(state: GatewayState, endpoint: str, raw: bytes, headers: Any) -> tuple[Call, dict[str, Any]]:
    """Everything before a worker is involved. Raises ApiError with ``call`` attached for records."""
    call = Call(state=state, active=state.active, endpoint=endpoint)
    try:
        call.route = call.active.keys.route_for(headers.get("authorization"))
        kind = ChatRequest if endpoint == "chat" else CompletionRequest
        body, request = parse_body(raw, kind)
        call.stream = request.stream
        call.include_usage = bool(request.stream_options and request.stream_options.include_usage)
        call.echo = isinstance(request, CompletionRequest) and request.echo
        wanted = call.active.wanted_headers
        picked = {h: headers[h] for h in wanted if h in headers} if wanted else None
        call.features = features = features_from_openai(body, route=call.route, headers=picked,
                                                        wanted_headers=set(wanted) if wanted else None)
        _check_model_and_window(state, request, features.prompt_tokens)
        limiter = call.active.limiters.get(call.route)
        cost = features.prompt_tokens + (request.budget or DEFAULT_RESERVED_COMPLETION)
        if limiter is not None:
            limiter.admit(cost)
            call.limiter, call.reserved_tokens = limiter, cost
    except ApiError as exc:
        exc.call = call  # type: ignore[attr-defined]
        raise
    call.decision = decision = decide(call.active.policy, features, state.snapshot(), rng=state.rng,
                                      exploring=state.exploring.keys())
    call.pool, call.proposer, call.draft_tokens = decision.pool, decision.proposer, decision.draft_tokens
    call.fallback = decision.fallback
    call.joined_at = time.monotonic()
    state.change_in_flight(1, call.joined_at)
    call.joined_area = state.busy_area(call.joined_at)
    call.counted = True
    call.exploring = exploration_key(decision)
    if call.exploring is not None:
        state.change_exploring(call.exploring, +1)
    return call, body


def _check_model_and_window(state: GatewayState, request: ChatRequest | CompletionRequest,
                            approx_prompt_tokens: int) -> None:
    backend = state.backend
    names = backend.model_names()
    if names and request.model not in names:
        raise ApiError(404, f"model `{request.model}` does not exist on this gateway; use one of: "
                       f"{', '.join(names)} (GET /v1/models)", param="model", code="model_not_found")
    window = backend.context_length()
    if window is None:
        return
    budget = request.budget
    if budget is not None and budget >= window:
        name = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
        raise ApiError(400, f"{name} is {budget} but the model's context window is {window} tokens; "
                       f"use at most {window - 1}", param=name, code="invalid_value")
    # the byte-based estimate can be 2x off for code; refuse only prompts surely over the window and
    # let the worker (which tokenizes) refuse the rest (mapped in errors.from_worker)
    if approx_prompt_tokens / 2 >= window:
        raise ApiError(400, f"the prompt is about {approx_prompt_tokens} tokens, over the model's "
                       f"context window of {window} tokens; shorten it",
                       param="messages" if isinstance(request, ChatRequest) else "prompt",
                       code="context_length_exceeded")


def _plan(call: Call) -> list[tuple[str, str, int, dict[str, Any] | None]]:
    """(pool, proposer, draft_tokens, speculation override) to try, in order."""
    policy, d = call.active.policy, call.decision
    assert d is not None
    plan = [(d.pool, d.proposer, d.draft_tokens, d.speculation_override)]
    plain = [p for p, spec in policy.pools.items() if spec.proposer == "none"]
    per_request = [p for p, spec in policy.pools.items() if spec.speculation == "per_request"]
    for name in plain + per_request:
        if name != d.pool or d.proposer != "none":
            per_req = policy.pools[name].speculation == "per_request"
            plan.append((name, "none", 0, {"proposer": "none"} if per_req else None))
    return plan


async def dispatch(call: Call, body: dict[str, Any],
                   send: Callable[[SGLangClient, dict[str, Any]], Awaitable[T]]) -> T:
    """Run ``send`` on a worker chosen by the plan, retrying as the module docstring says. On
    success ``call.worker`` holds the worker (acquired; the caller releases it via ``release``)."""
    state = call.state
    backend = state.backend
    tried: set[str] = set()
    last: WorkerError | None = None
    attempts = 0
    for pool_name, proposer, k, override in _plan(call):
        pool = backend.pools.get(pool_name)
        while pool is not None and attempts < state.settings.max_attempts:
            worker = pool.pick(time.monotonic(), exclude=tried)
            if worker is None:
                break
            url = worker.url
            tried.add(url)
            attempts += 1
            fwd = dict(body)
            fwd["rid"] = f"{call.request_id}-{attempts}"
            if override is not None:
                fwd["custom_params"] = {"speculation": override}
            pool.acquire(url)
            backend.in_flight += 1
            started = time.perf_counter()
            try:
                result = await send(backend.client(url), fwd)
            except asyncio.CancelledError:  # the client went away: free the slot, stop the worker
                call.upstream_s += time.perf_counter() - started
                pool.release(url)
                backend.in_flight -= 1
                call.worker, call.rid = url, fwd["rid"]
                state.spawn(abort_upstream(backend.client(url), fwd["rid"], state.settings.abort_timeout_s))
                raise
            except WorkerError as exc:
                call.upstream_s += time.perf_counter() - started
                pool.release(url)
                backend.in_flight -= 1
                if _worker_fault(exc):
                    pool.report_failure(url, time.monotonic(), str(exc))
                last = exc
                if not exc.retry_safe:
                    raise from_worker(exc) from None
                continue
            call.upstream_s += time.perf_counter() - started
            if (pool_name, proposer) != (call.pool, call.proposer):
                call.fallback = True
                call.fallback_note = f"; worker failure: served by pool '{pool_name}' without speculation"
            call.pool, call.proposer, call.draft_tokens = pool_name, proposer, k
            call.worker, call.retries = url, attempts - 1
            call.rid, call.backend = fwd["rid"], backend
            return result
    call.retries = max(0, attempts - 1)
    if last is None:
        raise ApiError(503, f"no healthy worker for pool '{call.pool}' or its plain fallback; "
                       "retry shortly", retry_after=2, code="no_healthy_worker")
    if isinstance(last, WorkerHTTPError) and last.status == 429:
        raise from_worker(last)
    raise ApiError(503, f"every worker tried failed (last: {last}); retry shortly", retry_after=2,
                   code="no_healthy_worker")


async def abort_upstream(client: SGLangClient, rid: str, timeout_s: float) -> None:
    """Fire-and-forget ``/abort_request``: the worker may have finished already or be gone."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.abort(rid), timeout_s)


def _worker_fault(exc: WorkerError) -> bool:
    """Failures that count against a worker's health (not the request's own 4xx, not overload)."""
    return not isinstance(exc, WorkerHTTPError) or exc.status >= 500


def release(call: Call, ok: bool) -> None:
    """The worker's part of the request is over (once per successful ``dispatch``)."""
    backend = call.backend
    if backend is None:
        return
    call.backend = None
    pool = backend.pools[call.pool]
    pool.release(call.worker)
    if ok:
        pool.report_success(call.worker, time.monotonic())
    backend.in_flight = max(0, backend.in_flight - 1)
