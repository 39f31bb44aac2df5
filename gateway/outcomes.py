"""``POST /v1/outcomes``: an application tells the gateway whether a request's task succeeded.

The outcome gate (``gateway/gates/book.py``, ``gates.outcome`` in the policy) compares, per pair version and
route, the success of requests a speculative pool served with the same route's plain requests. Body::

    {"request_id": "<x-specgate-request-id of the answer>", "success": true}     # or "score": 0.0..1.0

(``request_id`` may instead come in the ``x-specgate-request-id`` header.) Authenticated like the API: the key
names the route, and a route can only report its own requests (another route's id is unknown to it). Answers:
200 taken; 400 a bad body (naming the field); 404 an id this gateway does not know (never served, another
route's, or finished more than ``gates.outcome.ttl_s`` ago); 409 reported already, or the outcome gate is off.

In a fleet (the policy's ``state:``, ``gateway/fleet.py``) any replica takes the outcome of a request any replica
served, exactly once fleet-wide (``fleet_report``); while the state store is unreachable, only its own.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from litestar import Request, Response, post
from msgspec import Meta

from gateway.errors import ApiError
from gateway.fleet import FleetDown
from gateway.requests import field_of

if TYPE_CHECKING:
    from gateway.state import GatewayState

_JSON = "application/json"


class OutcomeReport(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    request_id: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    success: bool | None = None
    score: Annotated[float, Meta(ge=0, le=1)] | None = None


def _error(exc: ApiError) -> Response[bytes]:
    return Response(exc.body(), status_code=exc.status, media_type=_JSON, headers=exc.headers())


def parse_report(raw: bytes, header_id: str | None) -> tuple[str, float]:
    """(request id, score in [0, 1]) from a body, or ApiError 400 naming the field and the fix."""
    try:
        report = msgspec.json.decode(raw, type=OutcomeReport)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid outcome report: {exc}; send {{\"request_id\": ..., \"success\": true}} "
                       "or a \"score\" in [0, 1]", param=field_of(str(exc)), code="invalid_value") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not JSON ({exc})", code="invalid_json") from None
    rid = report.request_id or header_id
    if not rid:
        raise ApiError(400, "request_id is missing: give the answer's x-specgate-request-id in the body or "
                       "that header", param="request_id", code="missing_field")
    if (report.success is None) == (report.score is None):
        raise ApiError(400, "give exactly one of success (true/false) or score (0..1)", param="success",
                       code="invalid_value")
    return rid, float(report.success) if report.success is not None else float(report.score or 0.0)


async def fleet_report(state: GatewayState, rid: str, route: str, score: float) -> str | None | bool:
    """In a fleet (``gateway/fleet.py``): claim the report in the state store, exactly once fleet-wide, for a
    request any replica served; the other replicas' outcome gates read it from the store's report stream. Returns
    what ``GateBook.report`` does, or False when the store cannot answer (the caller then uses local state). A
    request finished here but not flushed yet is flushed first; one another replica finished within its last
    sync interval is looked up once more after that interval."""
    fleet = state.fleet
    outcome = state.gates.settings.outcome if state.gates.settings else None
    if fleet is None or not fleet.up:
        return False
    if outcome is None:
        return "off"
    try:
        if state.gates.served(rid, route, time.monotonic()) is not None:
            await state.sync_fleet()  # served here: its sample reaches the store before the claim
        for attempt in range(2):
            what, sample = await fleet.claim(rid, route, score, outcome.ttl_s)
            if what != "unknown" or attempt:
                break
            await asyncio.sleep(fleet.interval * 2)  # served elsewhere, maybe not flushed yet
    except FleetDown:
        return False
    if what == "taken" and sample is not None:
        state.gates.report_sample(sample, score, time.time())
        return None
    return what


def outcomes_handler(state: GatewayState) -> Any:
    @post("/v1/outcomes", status_code=200, summary="Report whether a request's task succeeded (the outcome gate)")
    async def outcomes(request: Request[Any, Any, Any]) -> Response[bytes]:
        try:
            route = state.active.keys.route_for(request.headers.get("authorization"))
            rid, score = parse_report(await request.body(), request.headers.get("x-specgate-request-id"))
        except ApiError as exc:
            return _error(exc)
        why = await fleet_report(state, rid, route, score)
        if why is False:  # no fleet, or its store is unreachable: this gateway's own requests only
            why = state.gates.report(rid, route, score, time.monotonic(), time.time())
        if why == "off":
            return _error(ApiError(409, "the outcome gate is off: the policy has no gates.outcome section",
                                   code="outcome_gate_off"))
        if why == "unknown":
            return _error(ApiError(404, f"request {rid} is unknown to this gateway for route {route}: not served "
                                   "here, another route's, or finished too long ago (gates.outcome.ttl_s)",
                                   param="request_id", code="unknown_request"))
        if why == "reported":
            return _error(ApiError(409, f"request {rid} already has an outcome; each request takes one",
                                   param="request_id", code="already_reported"))
        state.gate_runs.publish(time.monotonic())  # a hold takes effect on the next request
        return Response(msgspec.json.encode({"request_id": rid, "accepted": True}), media_type=_JSON)
    return outcomes
