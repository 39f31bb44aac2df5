"""``auto``: pick the pool and draft length with the best predicted speedup over plain decoding, or bypass.

For a candidate pool p (healthy, pair verified) and draft length k in its range:

    predicted TPOT(p, k) = t_round(p, k) / E[P](k)        speedup = t_plain / predicted TPOT

- E[P](k) from the conditional acceptance curve of (route, slice, p, pair version) (:mod:`policies.accept`;
  the route's own curve once it has ``min_rounds`` decayed rounds, else all routes pooled);
- t_round(p, k): seconds per speculative round (draft + verify + overhead) fitted per pool and
  concurrency bucket (:mod:`policies.cost`);
- t_plain: measured TPOT of requests served without speculation in this slice and concurrency bucket.

Where a pool has no per-position data (SGLang reports only totals) but has ``min_rounds`` rounds and
``min_requests`` requests, its measured TPOT per (pool, slice, bucket) replaces the model:
speedup = t_plain / TPOT(p). So does an ``adaptive`` pool's (the worker picks k per round and sequence, up
to the pool's draft_tokens): one option per pool, at its largest k. t_plain and the pool's fit (or TPOT)
come from the same concurrency bucket when one has both (the nearest to the current concurrency where both
have ``min_rounds`` of undecayed evidence, else the nearest where both exist), so a speedup never divides
times measured at different loads, nor trusts one request's timing at a new load.

A candidate that was never measured enough (``min_rounds`` rounds and ``min_requests`` requests,
counted without decay) is *cold*: not exploited (a new pair version has no evidence, and its curve starts
at the prior), only explored; so is plain decoding with fewer than ``min_rounds`` tokens of TPOT evidence
in the slice (t_plain is every speedup's numerator). While the slice has anything cold, with probability
``explore_cold`` the decision measures the least-sampled cold option (a pool at its largest k, which
measures every draft position): a cold pool needs only ``min_rounds`` rounds, a handful of requests, and
every other request still gets the best known option. A candidate with an estimate from fewer than
``confirm_requests`` requests, within reach of the served option (not below ``FAR`` x its speed), is
*unconfirmed* and explored at ``explore_cold`` too, so that two unlucky prompts cannot lock a winning pool
out; so is the served pool at a shorter k until its round time was measured at two k with ``min_rounds``
rounds each in some concurrency bucket (:func:`slope_probe`; a bucket without its own measured slope
borrows the nearest measured one, scaled to its own round time). Plain decoding is cold only while no
bucket has ``min_rounds`` tokens of it; a bucket reached for the first time takes the speedup of the
nearest bucket where plain and the pool were both measured, and plain is unconfirmed there (explored at
``explore_cold``) until it has ``min_rounds`` tokens within a factor of two of the current concurrency,
unless the served pool is predicted more than 1/``FAR`` x plain. A pool (or plain) already being explored
(the gateway passes the explorations in flight) is not explored again, at any k, before it reports: under open-loop
arrivals many requests are decided on the same evidence. A candidate measured enough once but whose *decayed*
evidence fell below the minimums is *stale*: still exploited on its estimate (ratios do not decay), and
re-measured at the low rate ``explore`` (the least-sampled stale option, plain included; one predicted
below ``FAR`` x the served speed only ``FAR_RATE`` as often); with nothing stale, ``explore`` serves the
best pool at its largest k (the tail of its curve), or at its smallest when it is served at its largest.
So losing pools and plain decoding cost a few percent of one request per half-life, not a burst of half
the traffic. The best candidate is used only if its speedup >= ``min_gain``.

A speedup is capped at the expected accept length (:func:`_capped`): a speculative round commits E[P](k)
tokens and costs at least one plain step (a wider forward is no faster, a draft is not free), so no pool can
beat plain by more. A prediction above it means plain and the pool were timed under different congestion
(measured under open-loop arrivals on one shared engine: 1.91x predicted from an accept length of 1.42).

Assumptions: acceptance depends on (route, slice, pool, pair version) but not on concurrency; cost
depends on (pool, concurrency bucket) and is linear in k; TPOT of plain decoding does not depend on
which plain pool serves it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from policies.accept import conditional_curve, expected_tokens
from policies.schema import Policy

# A stale candidate predicted below FAR x the speed of what is served now is re-measured FAR_RATE times as
# often as one that could plausibly win: on an engine that interleaves sequences, one slow request
# stretches the TPOT of every request in flight, and a pool at a quarter of the best speed is unlikely
# to have become the best. It is still re-measured, so an estimate that went wrong can recover.
FAR = 0.5
FAR_RATE = 0.1


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """One (pool, k) the optimizer considered, for explain and the admin endpoint."""

    pool: str
    draft_tokens: int
    eligible: bool
    note: str
    expected_accept_length: float | None = None
    predicted_tpot_ms: float | None = None
    speedup: float | None = None
    samples: float = 0.0  # decayed rounds of evidence
    cold: bool = False  # never measured enough (min_rounds / min_requests without decay): explore, never exploit
    unconfirmed: bool = False  # has an estimate, but from fewer than confirm_requests requests
    slope_unknown: bool = False  # the pool's round time lacks min_rounds rounds at a second k
    stale: bool = False  # measured enough once, but the decayed evidence is below those minimums


def candidates(policy: Policy, comp: Any, snap: Any, route: str, slice_: str, pools: tuple[str, ...]
               ) -> tuple[list[Candidate], float | None]:
    """Every (pool, k) option with its prediction; memoized in the snapshot. Returns (options, t_plain)."""
    key = ("auto", id(comp), route, slice_, pools)
    hit = snap._memo.get(key)
    if hit is None:
        hit = snap._memo[key] = _candidates(policy, comp, snap, route, slice_, pools)
    return hit


def _capped(speedup: float, accept_length: float | None) -> float:
    """``speedup`` no higher than the accept length that bounds it (see the module docstring)."""
    return speedup if accept_length is None else min(speedup, accept_length)


def _candidates(policy: Policy, comp: Any, snap: Any, route: str, slice_: str, pools: tuple[str, ...]
                ) -> tuple[list[Candidate], float | None]:
    learn = policy.learning
    plain = snap.tpot("none", slice_)
    t_plain = plain[0].mean if plain else None
    out: list[Candidate] = []
    for name in pools:
        pool = policy.pools[name]
        lo, hi = pool.k_range
        summary, f = snap.acceptance(route, slice_, name, comp.pair_versions[name], learn.min_rounds)
        rounds = summary.rounds * f if summary else 0.0
        requests = summary.requests * f if summary else 0.0
        measured_ever = summary is not None and summary.ever_requests >= learn.min_requests
        curve_ok = measured_ever and summary.ever_curve_rounds >= learn.min_rounds
        totals_ok = measured_ever and summary.ever_rounds >= learn.min_rounds
        stale = rounds < learn.min_rounds or requests < learn.min_requests
        plain_fit, fit = snap.plain_and(slice_, "rounds", name, learn.min_rounds)
        # an adaptive pool's k varies per round and per prompt: its curve and round-time fit describe the
        # worker's choices, not a k auto could pick, so only its measured TPOT counts
        use_curve = t_plain is not None and curve_ok and fit is not None and not pool.adaptive
        plain_measured, measured = (snap.plain_and(slice_, "tpot", name, learn.min_rounds)
                                    if t_plain is not None and totals_ok and not use_curve else (None, None))
        if t_plain is None:
            out.append(Candidate(pool=name, draft_tokens=hi, eligible=False, samples=rounds,
                                 cold=not (curve_ok or totals_ok), stale=stale,
                                 note="no plain TPOT measured yet for this slice"))
        elif use_curve:
            curve = conditional_curve(summary, learn.prior.accept, learn.prior.rounds, hi)
            e_p = expected_tokens(curve)
            unconfirmed = summary.ever_requests < learn.confirm_requests
            line = fit.round_time(learn.draft_token_cost, learn.min_rounds)
            donor = None if line.slope_measured else snap.measured_slope(name, learn.min_rounds)
            if donor is not None:
                line = line.shaped_like(donor.round_time(learn.draft_token_cost, learn.min_rounds)) or line
            note = "acceptance curve x round-time fit" + (" (slope from another load)" if line.borrowed else "")
            for k in range(lo, hi + 1):
                tpot = line.predict(k) / e_p[k]
                out.append(Candidate(pool=name, draft_tokens=k, eligible=True, samples=rounds, stale=stale,
                                     unconfirmed=unconfirmed, slope_unknown=not line.slope_measured,
                                     note=note, expected_accept_length=e_p[k],
                                     predicted_tpot_ms=tpot * 1e3, speedup=_capped(plain_fit.mean / tpot, e_p[k])))
        elif measured is not None:
            tpot = measured.mean
            out.append(Candidate(pool=name, draft_tokens=hi, eligible=True, samples=rounds, stale=stale,
                                 unconfirmed=summary.ever_requests < learn.confirm_requests,
                                 note=("measured TPOT (the worker picks k per sequence, up to this one)"
                                       if pool.adaptive else "measured TPOT (per-request totals only)"),
                                 expected_accept_length=summary.mean_accept_length,
                                 predicted_tpot_ms=tpot * 1e3,
                                 speedup=_capped(plain_measured.mean / tpot, summary.mean_accept_length)))
        else:
            ever_rounds = summary.ever_rounds if summary else 0.0
            ever_requests = summary.ever_requests if summary else 0.0
            out.append(Candidate(pool=name, draft_tokens=hi, eligible=False, samples=rounds, cold=True,
                                 stale=stale, note=f"cold: {ever_rounds:.0f} rounds / {ever_requests:.0f} "
                                 f"requests measured < min_rounds {learn.min_rounds} / min_requests "
                                 f"{learn.min_requests}"))
    return out, t_plain


def far_behind(c: Candidate, best: Candidate | None) -> bool:
    """Predicted below ``FAR`` times the speed of what auto serves now (the best pool, or plain)."""
    served = max(1.0, best.speedup) if best is not None else 1.0
    return c.speedup is not None and c.speedup < FAR * served


def unconfirmed(options: list[Candidate], best: Candidate | None, min_gain: float) -> list[Candidate]:
    """Candidates whose estimate rests on fewer than ``confirm_requests`` requests, within reach of what
    is served (not :func:`far_behind`), other than the pool being served (it gathers evidence anyway).
    Acceptance varies far more between prompts than between rounds of one prompt, so an estimate from two
    or three requests can put a winning pool just below plain; these are explored at the cold rate until
    confirmed."""
    served = best.pool if best is not None and best.speedup >= min_gain else None
    return [c for c in options if c.unconfirmed and c.eligible and not far_behind(c, best) and c.pool != served]


def slope_probe(options: list[Candidate], best: Candidate | None, min_gain: float) -> Candidate | None:
    """The served pool at a shorter k, midway between its smallest and the served one, while its round
    time lacks ``min_rounds`` rounds at a second k at every load (a slope measured at another load is
    borrowed, :meth:`policies.cost.RoundTime.shaped_like`): a few requests there fit the cost slope, so
    auto can weigh shorter drafts on measured cost instead of the prior's guess or one request's timing.
    Midway, not the smallest: on copy-friendly code k=1 is the costliest k (309-512 ms/token against
    19-337 for k=8 in one cell), and any second k identifies the line."""
    if best is None or best.speedup < min_gain or not best.slope_unknown:
        return None
    ks = {c.draft_tokens: c for c in options if c.pool == best.pool}
    k = (min(ks) + best.draft_tokens) // 2
    if k == best.draft_tokens:
        k = max(ks)
    return ks[k] if k != best.draft_tokens else None


def explore_target(options: list[Candidate], best: Candidate | None, cold: bool, far_ok: bool = True,
                   unsure: list[Candidate] | None = None, probe: Candidate | None = None,
                   busy: Callable[[Candidate], bool] = lambda c: False) -> Candidate | None:
    """What exploration measures (None: nothing among the pools; the caller weighs plain decoding).
    ``cold``: the least-sampled cold candidate, else the least-sampled of ``unsure`` (:func:`unconfirmed`),
    else ``probe`` (:func:`slope_probe`); the caller computes both once per decision. Else the least-sampled
    stale one (those :func:`far_behind` only if ``far_ok``), else the best pool at its largest k (its
    smallest when the best is already its largest, so round time is measured at two k). Cold, unconfirmed
    and stale ones at their pool's largest k, which measures every draft position. Never a candidate
    ``busy`` says is being explored already: its evidence has not come back, so another request spent on
    it would be decided on the same evidence (under open-loop arrivals three slope probes were started
    within 0.8 s on the same rounds)."""
    pick = (([c for c in options if c.cold and not busy(c)] or [c for c in unsure or () if not busy(c)]
             or ([probe] if probe and not busy(probe) else []))
            if cold else
            [c for c in options if c.stale and not busy(c) and (far_ok or not far_behind(c, best))])
    if not pick:
        if cold:
            return None
        same = [c for c in options if best is not None and c.pool == best.pool]
        if not same:
            return None
        end = max(same, key=lambda c: c.draft_tokens)
        if best is not None and best.draft_tokens == end.draft_tokens:
            end = min(same, key=lambda c: c.draft_tokens)  # the other end, so the cost slope gets measured
        return None if busy(end) else end
    target: Candidate | None = None
    for c in pick:
        if target is None or c.samples < target.samples or (c.pool == target.pool
                                                            and c.draft_tokens > target.draft_tokens):
            target = c
    return target


def best_option(options: list[Candidate]) -> Candidate | None:
    best: Candidate | None = None
    for c in options:
        if c.eligible and (best is None or c.speedup > best.speedup):
            best = c
    return best
