"""Full-information evidence in the gateway: a served greedy answer teaches ``auto`` what every fixed-k n-gram
and suffix option of its rule would have cost (replay/evidence.py has the method; docs/policy.md, "auto").

The decision names the options (``Decision.counterfactual``); such a request asks its worker for token ids (as a
traced one does); when it finishes, its outcome waits here, off the event loop, while one worker thread
computes each option's rounds from the ids and prices them with the serving worker's live step costs
(``/server_info``, ``policies.live_costs``), then goes to the learner
with the evidence attached. Outcomes reach the learner in the order they finish (one thread, FIFO), so the
suffix trees of the counterfactual see answers in that order. Nothing here can fail a request: a missing cost
model, a worker that sent no ids, a sampled request, or an error in the computation records the outcome
without evidence (an error is logged once per kind). The thread imports the engine's proposers (and torch)
on its first request: about 3 s and 300 MB once per gateway process, only where a rule offers such options.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from policies.costmodel import CostModelError
from policies.decide import Decision
from policies.live_costs import from_server_info
from policies.stats import Outcome, with_counterfactuals
from replay.evidence import EVALUATED, Counterfactuals

log = structlog.get_logger("specgate.evidence")
COSTS_REFRESH_S = 60.0  # a worker's live step costs are re-read at most this often


def wanted(decision: Decision | None, body: dict[str, Any]) -> bool:
    """Whether this request's answer can teach options it was not served with: its rule offered some, and it is
    greedy (temperature 0): a sampled answer's acceptance of a draft is not a function of its output."""
    return bool(decision is not None and decision.counterfactual and body.get("temperature") == 0)


class GatewayEvidence:
    """The gateway's counterfactual worker: one thread, one set of suffix trees (per route), cost models per
    worker URL. ``costs_for(url)``: the cost model to price a worker's rounds with, or None."""

    def __init__(self, costs_for: Callable[[str], Any],
                 observe: Callable[[str, str, int, float], None] | None = None) -> None:
        """``observe(route, slice, options taught, seconds)``: telemetry of each computed answer (on the loop)."""
        self._costs_for, self._observe = costs_for, observe
        self._counterfactuals = Counterfactuals()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specgate-evidence")
        self._errors: set[str] = set()

    def submit(self, outcome: Outcome, decision: Decision, worker: str, prompt_ids: list[int] | None,
               output_ids: list[int] | None, max_new: int, learn: Callable[[Outcome], None]) -> None:
        """Hand ``learn`` the outcome with ``decision``'s evidence attached, later, on the event loop (called from
        it); at once and unchanged when there is nothing to compute."""
        costs = self._costs_for(worker) if prompt_ids and output_ids and len(output_ids) >= 2 else None
        if costs is None:
            learn(outcome)
            return
        loop = asyncio.get_running_loop()

        def work() -> None:
            started = time.perf_counter()
            try:
                result = self._compute(outcome, decision, costs, prompt_ids, output_ids, max_new)
            except Exception as exc:  # never fails the request or the learner: the outcome goes without evidence
                result = outcome
                kind = type(exc).__name__
                if kind not in self._errors:
                    self._errors.add(kind)
                    log.warning("counterfactual evidence failed", error=kind, detail=str(exc)[:200])
            loop.call_soon_threadsafe(self._done, learn, result, time.perf_counter() - started)

        self._thread.submit(work)

    def _done(self, learn: Callable[[Outcome], None], outcome: Outcome, seconds: float) -> None:
        learn(outcome)
        if self._observe is not None:
            self._observe(outcome.route, outcome.slice, len(outcome.counterfactual), seconds)

    def _compute(self, outcome: Outcome, decision: Decision, costs: Any, prompt_ids: list[int],
                 output_ids: list[int], max_new: int) -> Outcome:
        served = (outcome.proposer, outcome.draft_tokens) if outcome.proposer in EVALUATED and \
            outcome.draft_tokens > 0 and outcome.pool == decision.pool and not _adaptive(decision) else None
        ratios, own = self._counterfactuals.ratios(costs, prompt_ids, output_ids, max_new, outcome.route,
                                                   max(1, outcome.concurrency), decision.counterfactual, served)
        return with_counterfactuals(outcome, ratios, own)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class WorkerCosts:
    """The cost model of each worker URL: its live step costs (``/server_info``, re-read every
    ``COSTS_REFRESH_S``), else None (an SGLang server reports none: its answers then teach only the option they
    were served with). ``reports``: the backend's ``step_cost_reports``."""

    def __init__(self, reports: Callable[[float], list[tuple[str, Any]]]) -> None:
        self._reports = reports
        self._models: dict[str, tuple[float, Any]] = {}

    def __call__(self, url: str) -> Any:
        now = time.monotonic()
        hit = self._models.get(url)
        if hit is not None and now - hit[0] < COSTS_REFRESH_S:
            return hit[1]
        model = None
        for worker, info in self._reports(now):
            if worker == url:
                try:
                    model = from_server_info(info, url)
                except CostModelError:
                    model = None
                break
        self._models[url] = (now, model)
        return model


def _adaptive(decision: Decision) -> bool:
    override = decision.speculation_override
    return bool(override is not None and override.adaptive)
