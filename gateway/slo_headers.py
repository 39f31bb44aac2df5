"""A request's own SLO: the ``x-slo-ttft-ms`` and ``x-slo-tpot-ms`` headers over its route's (docs/api.md).

The Gateway API Inference Extension's convention: a client states the time to first token and the time per
output token it needs, in milliseconds. A header given replaces that field of the route's SLO for this request
only; goodput (``slo_met``), the request's record and the policy's ``slo_*`` conditions read the result. The
route decides whether its clients may (``slo_override`` in the policy: ``allow``, ``min_ttft_ms``,
``min_tpot_ms``). A bad value is a 400 naming the header and the fix, never silently ignored.
"""

from __future__ import annotations

import math
from typing import Any

from gateway.errors import ApiError
from policies.schema import Policy, Slo, SloOverride

TTFT_HEADER, TPOT_HEADER = "x-slo-ttft-ms", "x-slo-tpot-ms"
MAX_SLO_MS = 600_000.0  # ten minutes: beyond it a target says nothing a request's timeout does not


def _value(name: str, text: str, floor: float | None) -> float:
    try:
        ms = float(text)
    except ValueError:
        ms = math.nan
    if not math.isfinite(ms) or ms <= 0 or ms > MAX_SLO_MS:
        raise ApiError(400, f"header {name} must be a number of milliseconds > 0 and <= {MAX_SLO_MS:g}, got "
                       f"{text!r}; send e.g. `{name}: 50` or leave the header out", param=name,
                       code="invalid_slo_header")
    if floor is not None and ms < floor:
        key = "min_ttft_ms" if name == TTFT_HEADER else "min_tpot_ms"
        raise ApiError(400, f"header {name} is {ms:g} ms, tighter than this route allows ({key}: {floor:g}); "
                       f"ask for at least {floor:g} ms or leave the header out", param=name,
                       code="invalid_slo_header")
    return ms


def request_slo(headers: Any, route: str, route_slo: Slo, override: SloOverride | None) -> Slo:
    """The SLO in force for one request: ``route_slo`` with the fields its headers give replaced (ApiError 400
    on a malformed, out-of-bounds or forbidden header). ``headers``: a mapping with lower-case ``get``."""
    ttft, tpot = headers.get(TTFT_HEADER), headers.get(TPOT_HEADER)
    if ttft is None and tpot is None:
        return route_slo
    if override is not None and not override.allow:
        name = TTFT_HEADER if ttft is not None else TPOT_HEADER
        raise ApiError(400, f"route '{route}' does not take per-request SLOs (slo_override.allow: false); remove "
                       f"the {name} header", param=name, code="invalid_slo_header")
    return Slo(ttft_ms=_value(TTFT_HEADER, ttft, override and override.min_ttft_ms) if ttft is not None
               else route_slo.ttft_ms,
               tpot_ms=_value(TPOT_HEADER, tpot, override and override.min_tpot_ms) if tpot is not None
               else route_slo.tpot_ms)


def slo_in_force(headers: Any, route: str, policy: Policy) -> tuple[Slo, dict[str, Any]]:
    """The request's SLO (:func:`request_slo` on ``policy``'s route SLO and override) and the ``RequestFeatures``
    fields that carry it, ``slo_tpot_stated`` included: what admission, ``/admin/explain`` and
    ``specgate policy explain`` all hand to ``features_from_openai``."""
    slo = request_slo(headers, route, policy.route_slo(route), policy.route_slo_override(route))
    return slo, {"slo_ttft_ms": slo.ttft_ms, "slo_tpot_ms": slo.tpot_ms,
                 "slo_tpot_stated": headers.get(TPOT_HEADER) is not None}
