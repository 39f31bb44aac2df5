"""A request's life, owned by one function: ``serve`` runs read -> admit -> limits -> decide -> dispatch
(retries, fallback) -> answer (JSON, or the relayed stream) -> finish, and every release happens in its
one ``finally``, so no exit path (an error at any stage, a client that leaves, a worker that fails, a
cancelled task) can leak a limiter reservation, an in-flight count, an exploration slot or a worker slot.

``serve`` is an async generator. Its first item is the ``Head`` of the answer: a whole answer (JSON or an
error) carries its body; a stream's head carries only status and headers, and the stream's chunks follow.
The app returns the head, or a ``Stream`` over the rest of the same generator; the generator's end (the
stream ended, the client left and it was closed, or the app resumed it after handing a whole answer over)
ends the request.
A generator that nobody iterates any more is closed by the event loop's async-generator finaliser, so the
``finally`` runs even when a client leaves before its stream's first byte.

Stages (``gateway/stages.py``): read and admit here, limits and counts in ``gateway/holds.py``, the
decision in ``policies.decide``, dispatch with retries and the fallback in ``gateway/dispatch.py``, the
stream relay in ``gateway/relay.py``; ``Finished`` is built once, here, and feeds the learner, telemetry and
the trace recorder (``gateway/tracing.py``, which picks its requests at admission).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncGenerator
from functools import partial
from typing import Any

import msgspec

from backends.disconnect import unless_client_leaves
from backends.sglang.client import SGLangClient
from backends.sglang.errors import WorkerError
from backends.sglang.token_ids import strip
from gateway import stages
from gateway.dispatch import NotServed, abort_upstream, close_quietly, dispatch, sender
from gateway.errors import ApiError
from gateway.evidence import wanted
from gateway.holds import Holds, Stopwatch
from gateway.relay import DONE, Tally, assemble, inject, relay_stream
from gateway.resume import Progress, Resumer, not_resumable, stops_of
from gateway.request_spans import begin
from gateway.requests import ChatRequest, CompletionRequest, parse_body
from gateway.slo_headers import slo_in_force
from gateway.stages import Admitted, Arrival, Dispatched, Ending, Finished
from gateway.state import Active, GatewayState
from policies.decide import Decision, decide
from policies.features import features_from_openai
from policies.slicing import needs_code_score

DEFAULT_RESERVED_COMPLETION = 256  # tokens reserved against tokens_per_min when max_tokens is absent
JSON = "application/json"
# the token budget replayed for an answer without max_tokens: its drafts were never cut by the budget
MAX_NEW_UNKNOWN = 1 << 20
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class Head(msgspec.Struct, frozen=True, gc=False):
    """The start of an answer: status and headers, and the whole body unless a stream follows."""

    status: int
    headers: dict[str, str]
    body: bytes | None  # None: a text/event-stream follows


def request_id() -> str:
    """A random (version 4) UUID as 32 hex digits, as ``uuid.uuid4().hex`` but without building a ``UUID``."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    return b.hex()


def body_too_large(limit: int, size: str = "") -> ApiError:
    """The 413 of a body over ``--max-body-bytes``: its declared ``size`` when known (content-length), or the
    bytes received past the limit (``app.RawRequest``)."""
    return ApiError(413, f"request body is {size + ' bytes, ' if size else ''}over this gateway's limit of {limit} "
                    "bytes (--max-body-bytes); send a shorter prompt", code="body_too_large")


async def read_body(request: Any, headers: Any, limit: int) -> bytes:
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit, declared)
    return await request.body()


def admit(state: GatewayState, arrival: Arrival, active: Active, route: str, body: dict[str, Any],
          request: ChatRequest | CompletionRequest, headers: Any) -> Admitted:
    """Features and the model/window checks (ApiError when refused); no limit is taken here."""
    wanted = active.wanted_headers
    picked = {h: headers[h] for h in wanted if h in headers} if wanted else None
    trace_ids = state.recorder.select(route, arrival.request_id) == "record"
    policy = active.policy
    slo, slo_fields = slo_in_force(headers, route, policy)
    features = features_from_openai(body, route=route, headers=picked, wanted_headers=set(wanted) if wanted else None,
                                    repeat=active.reads_repeat or trace_ids,  # a trace keeps every feature
                                    code=True if trace_ids else partial(needs_code_score, policy), **slo_fields)
    _check_model_and_window(state, request, features.prompt_tokens)
    return Admitted(
        trace_ids=trace_ids, slo=slo,
        arrival=arrival, active=active, route=route, body=body, features=features, stream=request.stream,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        echo=isinstance(request, CompletionRequest) and request.echo,
        cost_tokens=features.prompt_tokens + (request.budget or DEFAULT_RESERVED_COMPLETION))


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


async def serve(state: GatewayState, endpoint: str, request: Any) -> AsyncGenerator[Head | bytes, None]:
    """The one owner of a request's life (module docstring). ``request``: headers, ``body()`` and the ASGI
    ``receive`` channel (watched for a client that leaves while the worker computes)."""
    arrival = Arrival(request_id=request_id(), endpoint=endpoint, t0=time.perf_counter())
    active = state.active  # the policy version this request runs under
    holds, waited, tally = Holds(state), Stopwatch(), Tally(arrival.t0)
    route, stream, retries = "", False, 0
    admitted: Admitted | None = None
    decision: Decision | None = None
    dispatched: Dispatched | None = None
    ending: Ending | None = None
    handed_over: float | None = None  # perf_counter when a whole answer was handed to the server
    relaying: tuple[Any, SGLangClient] | None = None  # a worker stream being relayed, until it ends
    evidence = False  # its outcome waits for full-information evidence (gateway/evidence.py)
    resumer: Resumer | None = None  # a stream that may continue on another worker (gateway/resume.py)
    otel = state.otel  # OpenTelemetry export (telemetry/otel.py); None: off, and no span object is built
    # spans: a sampled request's; unsampled: an unsampled one's traceparent for its workers (gateway/request_spans.py)
    spans, unsampled = begin(otel, request.headers, endpoint) if otel is not None else (None, None)

    def head_headers() -> dict[str, str]:
        overhead = max(0.0, time.perf_counter() - arrival.t0 - waited.seconds)
        return stages.headers(arrival, route, decision, dispatched, retries, overhead)

    try:
        try:
            headers = request.headers
            raw = await read_body(request, headers, state.settings.max_body_bytes)
            route = active.keys.route_for(headers.get("authorization"))
            body, parsed = parse_body(raw, ChatRequest if endpoint == "chat" else CompletionRequest)
            stream = parsed.stream
            admitted = admit(state, arrival, active, route, body, parsed, headers)
            if admitted.trace_ids:
                tally.want_ids()
            holds.take_limits(admitted)
            if spans is not None:
                spans.admitted()
            decision = decide(active.policy, admitted.features, state.snapshot(), rng=state.rng,
                              exploring=state.exploring)
            holds.count(decision)
            if spans is not None:
                spans.decided()
            resume = active.policy.resume
            resumable = resume.max_resumes > 0 and not_resumable(admitted.body) is None
            # a whole answer that may resume is streamed from its worker and assembled here (resume.whole_answers)
            assembled = (not admitted.stream and resumable and resume.whole_answers and not admitted.echo
                         and body.get("n") in (None, 1)
                         and (endpoint != "chat" or state.backend.chat_stream_ids(decision.pool)))
            may_resume = (admitted.stream and resume.max_resumes > 0) or assembled
            ids = (admitted.stream or assembled) and resumable  # the ids a resume continues from
            # a greedy answer that can teach auto options it was not served with (gateway/evidence.py)
            evidence = wanted(decision, admitted.body)
            if evidence and not admitted.trace_ids:
                tally.want_ids()
            ids = ids or evidence
            answered, served = await unless_client_leaves(
                request.receive, dispatch(state, admitted, decision, holds, waited,
                                                sender(admitted, ids, admitted.stream or assembled), spans,
                                                unsampled))
        except (ApiError, NotServed) as exc:
            error = exc.error if isinstance(exc, NotServed) else exc
            retries = exc.retries if isinstance(exc, NotServed) else 0
            ending, handed_over = Ending.of(error), time.perf_counter()
            yield Head(error.status, {**head_headers(), **error.headers()}, error.body())
            return
        if not answered:  # dispatch already freed the worker slot and sent /abort_request
            ending, handed_over = stages.CLIENT_LEFT, time.perf_counter()
            yield Head(499, head_headers(), b"")
            return
        assert served is not None
        dispatched, result = served
        retries = dispatched.retries
        if spans is not None:
            spans.dispatched()

        def info() -> bytes:
            assert decision is not None and dispatched is not None
            return stages.info_json(arrival, route, decision, dispatched, tally.relayed(),
                                    tuple(resumer.steps) if resumer is not None else ())

        if not admitted.stream and not assembled:
            tally.take(result.parsed)
            content = inject(strip(result.raw) if admitted.trace_ids or ids else result.raw, info())
            ending, handed_over = stages.OK, time.perf_counter()
            yield Head(200, head_headers(), content)
            return
        upstream, first = result
        relaying = (upstream, state.backend.client(dispatched.worker))
        if may_resume:
            resumer = Resumer(state, admitted, decision, dispatched, holds,
                              Progress(endpoint == "chat", stops_of(admitted.body)), spans, unsampled)

        def failed(exc: WorkerError) -> ApiError:
            """The error a worker failure after the first chunk ends the answer with (its request aborted)."""
            nonlocal relaying, ending
            assert relaying is not None and dispatched is not None
            client, relaying = relaying[1], None  # its worker request is aborted here, not again below
            not_resumed = ""
            if resumer is None or not resumer.steps:
                holds.fail_worker(exc)
                state.spawn(abort_upstream(client, dispatched.rid, state.settings.abort_timeout_s))
            else:  # the resumer reported the failure and aborted the failed worker's request
                not_resumed = f"; not resumed: {resumer.steps[-1].outcome}"
            error = ApiError(502, f"the worker failed mid-answer: {exc.message}{not_resumed}", code="upstream_error")
            ending = Ending(502, "upstream_error", "WorkerError", error.message)
            return error

        if assembled:
            try:
                answered, content = await unless_client_leaves(
                    request.receive, assemble(tally, admitted, upstream, first, info, waited, resumer))
            except WorkerError as exc:
                error = failed(exc)
                handed_over = time.perf_counter()
                yield Head(error.status, {**head_headers(), **error.headers()}, error.body())
                return
            handed_over = time.perf_counter()
            if not answered:  # the client left: the worker's request is aborted below
                ending = stages.CLIENT_LEFT
                yield Head(499, head_headers(), b"")
                return
            assert content is not None
            ending, relaying = stages.OK, None
            yield Head(200, head_headers(), content)
            return
        yield Head(200, {**head_headers(), **SSE_HEADERS}, None)
        try:
            async with contextlib.aclosing(relay_stream(tally, admitted, upstream, first, info, waited, resumer,
                                                        ids)) as chunks:
                async for chunk in chunks:
                    yield chunk
            ending, relaying = stages.OK, None
        except WorkerError as exc:
            yield failed(exc).stream_chunk()
            yield DONE
    except (GeneratorExit, asyncio.CancelledError):
        ending = ending or stages.CLIENT_LEFT  # the client went away (a whole answer's ending is already set)
        raise
    finally:
        if relaying is not None:  # the stream did not end (client left, or a gateway error): stop the worker's part
            upstream, client = relaying
            rid = dispatched.rid if dispatched else ""
            if resumer is not None and resumer.rid != rid:  # a resumed stream: its current worker's request
                client, rid = state.backend.client(resumer.worker), resumer.rid
            state.spawn(close_quietly(upstream))
            state.spawn(abort_upstream(client, rid, state.settings.abort_timeout_s))
        relayed = tally.relayed()
        mean = holds.release(used_tokens=relayed.prompt_tokens + relayed.completion_tokens)
        pool = stages.served_by(decision, dispatched)[0]
        finished = Finished(
            arrival=arrival, route=route, stream=stream, admitted=admitted, decision=decision, dispatched=dispatched,
            retries=retries, relayed=relayed, ending=ending or stages.INTERNAL, e2e_s=time.perf_counter() - arrival.t0,
            overhead_s=max(0.0, (handed_over or time.perf_counter()) - arrival.t0 - waited.seconds),
            mean_concurrency=mean,
            slo=admitted.slo if admitted is not None else active.policy.route_slo(route) if route else None,
            pair_version=active.pair_versions.get(pool, ""),
            resumes=tuple(resumer.steps) if resumer is not None else ())
        # the learner and telemetry hear of it once, from one value; a resumed answer's TPOT and counters span two
        # workers (maybe two pools) and the gap between, so the learner does not learn from it
        learned = None if finished.resumed else stages.outcome(finished)
        if learned is not None and evidence and dispatched is not None and decision is not None:
            state.evidence.submit(learned, decision, dispatched.worker, relayed.prompt_ids, relayed.output_ids,
                                  admitted.features.max_tokens or MAX_NEW_UNKNOWN, state.learn)
        elif learned is not None:
            state.learn(learned)
        record = stages.record(finished)
        if spans is not None:
            spans.finish(finished, record)
        state.telemetry.observe(record)
        state.gate_runs.observe(record)
        state.recorder.finish(finished)
