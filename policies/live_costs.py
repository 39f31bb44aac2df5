"""A running specgate worker's live step costs as a replay cost model (docs/replay.md, "A running
worker's live step costs"): what its ``/server_info`` reports of the engine's step-cost table, turned into a
:class:`policies.costmodel.CostModel` with one context length. Pure, like policies/costmodel.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from policies.costmodel import CostModel, CostModelError, check_revision, from_measurements


class ReportedCosts(Protocol):
    """What a specgate worker's ``/server_info`` reports of its engine's step costs: the fields of
    ``backends.sglang.wire.ServerInfo`` read here (policies import no backend code)."""

    served_model_name: str | None
    model_path: str | None
    revision: str | None
    dtype: str | None
    specgate_step_costs: list[tuple[int, int, float]]  # [sequences, tokens in the step, seconds] per forward
    specgate_step_costs_context: int | None  # tokens cached before the start-up calibration's forwards
    specgate_draft_token_s: dict[str, float]  # seconds per drafted token, proposers that drafted
    specgate_round_overhead_s: float


_INSTEAD = ("price replay with a cost model file instead: specgate trace calibrate --out FILE, or one filled from "
            "SGLang's benchmarks (docs/replay.md)")


def from_server_info(info: ReportedCosts, url: str, *, revision: str | None = None, created: str = "") -> CostModel:
    """The CostModel of the live step costs a specgate worker at ``url`` reports, checked as a file is
    (``revision``: the trace's, as ``load_cost_model`` checks it).

    Per sequence count n of ``specgate_step_costs`` a forward grid by tokens per sequence: a row of T tokens
    is width T / n (T not a multiple of n, a step of sequences at different widths, is left out; a mixed step
    whose T is a multiple counts at its mean width), at the
    ONE context the start-up calibration measured at, so attention's growth with the context is not priced.
    The prefill grid is the one-sequence rows (the engine measures no prefill chunk apart). ``draft``: per
    proposer that drafted, its seconds per drafted token at any context as ``token_s`` (the engine's figure
    includes the call; no ``call_s``, no prompt ``setup_token_s``). ``hardware``: the dtype only (the worker
    reports no processor)."""
    url = url.rstrip("/")
    where = f"{url}/server_info"
    context = info.specgate_step_costs_context
    if not info.specgate_step_costs:
        raise CostModelError(f"{where}: field specgate_step_costs: empty or absent (an SGLang server reports "
                             f"none; a specgate worker once it calibrated or served); {_INSTEAD}")
    if context is None:
        raise CostModelError(f"{where}: field specgate_step_costs_context: not reported, so the context the table "
                             "was measured at is unknown (the worker started with --no-calibrate); restart it "
                             f"without --no-calibrate, or {_INSTEAD}")
    widths = _widths(info.specgate_step_costs)
    if 1 not in widths:
        raise CostModelError(f"{where}: field specgate_step_costs: no one-sequence rows [1, tokens, seconds] (only "
                             f"sequence counts {sorted(widths)}); {_INSTEAD}")
    batch = sorted(widths)
    grids = [_grid(widths[n], context) for n in batch]
    model = from_measurements(dict(
        model=info.served_model_name or info.model_path or "", revision=info.revision or "",
        hardware=info.dtype or "", source=f"specgate worker /server_info at {url}", created=created, batch=batch,
        forward=grids, prefill=grids[0], overhead_s=info.specgate_round_overhead_s,
        draft={name: dict(token_s=[seconds]) for name, seconds in info.specgate_draft_token_s.items()}), where)
    check_revision(model, revision, where)
    return model


def _widths(table: Sequence[tuple[int, int, float]]) -> dict[int, dict[int, float]]:
    """Seconds by sequence count and tokens per sequence, of the rows whose tokens split evenly."""
    widths: dict[int, dict[int, float]] = {}
    for sequences, tokens, seconds in table:
        if tokens % sequences == 0:
            widths.setdefault(sequences, {})[tokens // sequences] = seconds
    return widths


def _grid(seconds: dict[int, float], context: int) -> dict[str, list]:
    """A one-column grid: ``seconds`` by width, all at ``context``."""
    tokens = sorted(seconds)
    return dict(tokens=tokens, context=[context], seconds=[[seconds[width]] for width in tokens])
