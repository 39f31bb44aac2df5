"""Dispatch: the worker a decided request goes to, with retries and the plain fallback.

Retry rule (docs/architecture.md, "A request's life"): a worker failure before the first byte reached
our client is retried on another worker of the decided pool, then on the plain fallback (a pool with proposer none, else the
same per-request workers with speculation off); at most ``max_attempts`` tries in all. A worker's
4xx (the request's own fault) is answered at once. A failed or cancelled attempt's worker slot is
given back here and its worker request aborted; a successful one's slot goes into the request's ``Holds``.

The gateway owns ``custom_params`` (a client's is refused at parsing, and never forwarded): an attempt on a
``per_request`` pool carries the plan's ``speculation`` override, and every override, and every attempt
on a pool whose proposer is ``suffix`` (whose server-mode workers draft by default), carries ``scope`` =
the request's route. Suffix decoding drafts from a global tree of earlier outputs kept per scope, so the
scope is what keeps one application's completions out of another's drafts; a client cannot choose it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from backends.sglang.client import OpenAIResult, SGLangClient
from backends.sglang.errors import WorkerError, WorkerHTTPError, WorkerStreamError
from backends.sglang.token_ids import request_fields
from gateway.errors import ApiError, from_worker
from gateway.holds import Holds, Stopwatch, worker_fault
from gateway.request_spans import RequestSpans
from gateway.stages import Admitted, Dispatched
from gateway.state import GatewayState
from policies.decide import Decision, plan_attempts
from policies.schema import Pool
from speculation import SpeculationOverride

T = TypeVar("T")


def custom_params(pool: Pool, override: SpeculationOverride | None, route: str) -> dict[str, Any] | None:
    """The ``custom_params`` of an attempt on ``pool`` (None: send none): the decision's speculation override
    in the route's scope, or only the scope for a suffix-drafting server pool (its workers' default)."""
    if override is not None:
        spec = msgspec.structs.replace(override, scope=route)
    elif pool.proposer in ("suffix", "hybrid"):
        spec = SpeculationOverride(scope=route)
    else:
        return None
    return {"speculation": msgspec.to_builtins(spec)}


class NotServed(Exception):
    """Every attempt failed (or none was possible): the error to answer and the retries made."""

    def __init__(self, error: ApiError, retries: int) -> None:
        super().__init__(error.message)
        self.error, self.retries = error, retries


async def dispatch(state: GatewayState, admitted: Admitted, decision: Decision, holds: Holds, waited: Stopwatch,
                   send: Callable[..., Awaitable[T]], spans: RequestSpans | None = None,
                   unsampled: dict[str, str] | None = None) -> tuple[Dispatched, T]:
    """Run ``send`` on a worker chosen by the plan, retrying as the module docstring says. On success
    the worker's slot is in ``holds``; a failed attempt's slot is given back here. NotServed otherwise.
    ``send(client, body, headers)``: ``headers`` is the ``traceparent`` that makes the worker's span the attempt's
    child (``spans``: a sampled request's, each attempt a ``dispatch`` span), ``unsampled`` (an unsampled one's), or
    None (trace export off)."""
    backend = state.backend
    tried: set[str] = set()
    last: WorkerError | None = None
    attempts = 0
    pools = admitted.active.policy.pools
    for pool_name, proposer, k, override in plan_attempts(admitted.active.policy, decision):
        custom = custom_params(pools[pool_name], override, admitted.route)
        pool = backend.pools.get(pool_name)
        while pool is not None and attempts < state.settings.max_attempts:
            worker = pool.pick(time.monotonic(), exclude=tried)
            if worker is None:
                break
            url = worker.url
            tried.add(url)
            attempts += 1
            fwd = dict(admitted.body)
            fwd["rid"] = f"{admitted.arrival.request_id}-{attempts}"
            if custom is None:
                fwd.pop("custom_params", None)
            else:
                fwd["custom_params"] = custom
            backend.take(pool_name, url)
            span, headers = (None, unsampled) if spans is None else \
                spans.attempt(attempts, pool_name, proposer, k, url, fwd["rid"])
            try:
                with waited:
                    result = await send(backend.client(url), fwd, headers)
                if span is not None:
                    span.end()
            except (asyncio.CancelledError, WorkerError) as exc:
                if span is not None:
                    span.fail(type(exc).__name__, str(exc) or "cancelled")
                backend.give_back(pool_name, url)  # this attempt's slot; a served attempt's goes into holds
                if not isinstance(exc, WorkerHTTPError):  # the client left, or a timeout or broken
                    # connection: the request may still run there, so never leave it computing for nobody
                    state.spawn(abort_upstream(backend.client(url), fwd["rid"], state.settings.abort_timeout_s))
                if isinstance(exc, asyncio.CancelledError):
                    raise
                if worker_fault(exc):
                    pool.report_failure(url, time.monotonic(), str(exc))
                last = exc
                if not exc.retry_safe:
                    raise NotServed(from_worker(exc), attempts - 1) from None
                continue
            holds.hold_worker(backend, pool_name, url)
            fell_back = (pool_name, proposer) != (decision.pool, decision.proposer)
            return Dispatched(
                pool=pool_name, proposer=proposer, draft_tokens=k, worker=url, rid=fwd["rid"], retries=attempts - 1,
                fallback=fell_back or decision.fallback,
                fallback_note=f"; worker failure: served by pool '{pool_name}' without speculation" if fell_back
                else ""), result
    retries = max(0, attempts - 1)
    if last is None:
        raise NotServed(ApiError(503, f"no healthy worker for pool '{decision.pool}' or its plain fallback; "
                                 "retry shortly", retry_after=2, code="no_healthy_worker"), retries)
    if isinstance(last, WorkerHTTPError) and last.status == 429:
        raise NotServed(from_worker(last), retries)
    raise NotServed(ApiError(503, f"every worker tried failed (last: {last}); retry shortly", retry_after=2,
                             code="no_healthy_worker"), retries)


async def abort_upstream(client: SGLangClient, rid: str, timeout_s: float) -> None:
    """Fire-and-forget ``/abort_request``: the worker may have finished already or be gone."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.abort(rid), timeout_s)


async def close_quietly(upstream: Any) -> None:
    with contextlib.suppress(Exception):
        await upstream.aclose()


def sender(admitted: Admitted, resumable: bool = False, stream: bool | None = None) -> Callable[..., Awaitable[Any]]:
    """The worker call: the whole JSON answer, or a stream opened up to its first chunk (``stream``; None: as the
    client asked). A request selected for the trace, or one that may resume (``gateway/resume.py``), also asks
    for its token ids (``backends/sglang/token_ids.py``); ``headers``: the attempt's ``traceparent`` when trace
    export is on."""
    chat = admitted.arrival.endpoint == "chat"
    ids = request_fields(chat) if admitted.trace_ids or resumable else {}
    if not (admitted.stream if stream is None else stream):
        async def whole(client: SGLangClient, fwd: dict[str, Any], headers: dict[str, str] | None = None
                        ) -> OpenAIResult[Any]:
            fwd = {**fwd, **ids} if ids else fwd
            return await (client.chat_completions(fwd, headers=headers) if chat
                          else client.completions(fwd, headers=headers))
        return whole

    async def opened(client: SGLangClient, fwd: dict[str, Any], headers: dict[str, str] | None = None
                     ) -> tuple[Any, OpenAIResult[Any]]:
        fwd = {**fwd, "stream_options": {"include_usage": True}, **ids}  # the gateway always asks for usage
        stream = client.chat_completions_stream(fwd, headers=headers) if chat \
            else client.completions_stream(fwd, headers=headers)
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            raise WorkerStreamError(client.base_url, "stream ended before any chunk", bytes_received=False) from None
        except BaseException:
            await stream.aclose()
            raise
        return stream, first
    return opened
