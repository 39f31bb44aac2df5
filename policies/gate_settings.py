"""The policy file's ``gates:`` section: the rollout gates a target-draft pair version passes before it serves
(docs/architecture.md, "The gates"), and the collapse detector that watches it afterwards. The gates themselves run
in the gateway (``gateway/gates/``); this module only holds their settings (re-exported by
:mod:`policies.schema`). docs/policy.md documents every key and its default.

Without a ``gates:`` section no gate runs (a pool serves once its workers report the declared pair, as
before); with one, every pool that has a pair starts ``pending`` and serves no user traffic until its
equivalence gate passes. A gate set to ``null`` (``serving: null``) is switched off on its own.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from policies.schema_base import Fraction, PosFloat, PosInt, _Strict

GateState = Literal["pending", "passed", "failed", "degraded"]
GATE_STATES: tuple[str, ...] = ("pending", "passed", "failed", "degraded")


class SampledCheck(_Strict, kw_only=True):
    """The distribution half of the equivalence gate: ``samples`` seeded sampled completions of
    ``max_tokens`` tokens from the speculative pool and as many from the plain reference, on each of the first
    ``prompts`` canaries; per position, a chi-square test of homogeneity of the token distributions, rejected
    when any position's p-value is below ``alpha`` / positions (Bonferroni). Exact speculative sampling keeps
    the target's distribution, so a correct pair fails this with probability at most ``alpha``."""

    samples: Annotated[int, Meta(ge=8, le=4096)] = 48
    max_tokens: Annotated[int, Meta(ge=2, le=64)] = 4
    temperature: PosFloat = 1.0
    prompts: PosInt = 1
    alpha: Annotated[float, Meta(gt=0, lt=1)] = 0.001
    seed: int = 0


class Equivalence(_Strict, kw_only=True):
    """Greedy token identity of every canary through the speculative pool and a plain reference, plus the
    sampled check. ``canaries``: a JSON Lines file (relative to the policy file) of ``{"id", "slice",
    "prompt"}`` or ``{"id", "slice", "messages"}``; None: the built-in set (one prompt per slice kind).
    ``per_slice``/``max_canaries``: how many of them run; ``timeout_s``: the whole gate's budget (past it the
    run counts as an error, not a verdict, and is retried after ``retry_s``; generous, because CPU machines
    differ 4x in speed and a run that never fits would keep the pool pending); ``concurrency``: canary
    requests in flight at once. The gateway runs one pool's gate at a time."""

    canaries: Annotated[str, Meta(min_length=1)] | None = None
    per_slice: PosInt = 1
    max_canaries: Annotated[int, Meta(ge=1, le=1000)] = 8
    max_tokens: Annotated[int, Meta(ge=1, le=4096)] = 32
    timeout_s: PosFloat = 600.0
    retry_s: PosFloat = 30.0
    concurrency: Annotated[int, Meta(ge=1, le=64)] = 4
    sampled: SampledCheck | None = SampledCheck()


class Serving(_Strict, kw_only=True):
    """The ramp, per load region (slice x concurrency bucket): a region starts at ``initial_share`` of the
    requests the policy sends to the pool (the rest are served plain, on the same slice and load, as the
    comparison); after every ``window`` speculative and ``window`` plain requests in the region, the share
    grows by ``growth`` while the pool's median TPOT is at most ``max_tpot_ratio`` x plain's, its median TTFT
    at most ``max_ttft_ratio`` x plain's and its SLO attainment at least ``min_slo_ratio`` x plain's; at
    share 1 the region is open. A window that misses any bound closes the region (the pool is bypassed
    there) for ``retry_s``, then the region ramps again from ``initial_share``."""

    initial_share: Annotated[float, Meta(gt=0, le=1)] = 0.25
    growth: Annotated[float, Meta(gt=1)] = 2.0
    window: PosInt = 8
    max_tpot_ratio: PosFloat = 1.0
    max_ttft_ratio: PosFloat = 1.5
    min_slo_ratio: Fraction = 0.97
    retry_s: PosFloat = 600.0


class OutcomeCheck(_Strict, kw_only=True):
    """Task outcomes that applications report (``POST /v1/outcomes``), per pair version and route, against the
    same route's plain requests: a one-sided test (Welch's t on success scores) holds the pair back
    (``failed``) when the speculative mean is shown below plain's minus ``max_drop`` at level ``alpha``,
    once each side has ``min_reports``. A route that reports nothing is never blocked. A request's id takes
    a report for ``ttl_s`` after it finished; at most ``max_tracked`` finished requests are remembered."""

    min_reports: Annotated[int, Meta(ge=2)] = 20
    alpha: Annotated[float, Meta(gt=0, lt=1)] = 0.01
    max_drop: Fraction = 0.02
    ttl_s: PosFloat = 3600.0
    max_tracked: Annotated[int, Meta(ge=1, le=10_000_000)] = 100_000


class Collapse(_Strict, kw_only=True):
    """Live, per pool and slice, over the last ``window_rounds`` verification rounds: ``degraded`` when the
    accept length falls below ``floor`` where the baseline was at least ``min_baseline``, or when the
    histogram of accepted drafts per round shifts down from the baseline's (chi-square, ``shift_alpha``). The
    baseline is the canaries' accept length at the equivalence gate, replaced per slice by the first full
    window of live traffic after it. A degraded pool that serves no traffic is re-checked through the
    equivalence gate after ``recheck_s``; its canaries must then also accept above ``floor``."""

    window_rounds: Annotated[int, Meta(ge=8)] = 200
    floor: Annotated[float, Meta(ge=1.0)] = 1.05
    min_baseline: Annotated[float, Meta(ge=1.0)] = 1.3
    shift_alpha: Annotated[float, Meta(gt=0, lt=1)] | None = 0.001
    recheck_s: PosFloat = 300.0

    def __post_init__(self) -> None:
        if self.floor >= self.min_baseline:
            raise ValueError(f"floor {self.floor:g} must be below min_baseline {self.min_baseline:g}: a pair whose "
                             "baseline lies between them would be flagged at once")


class Gates(_Strict, kw_only=True):
    equivalence: Equivalence = Equivalence()
    serving: Serving | None = Serving()
    outcome: OutcomeCheck | None = OutcomeCheck()
    collapse: Collapse | None = Collapse()
