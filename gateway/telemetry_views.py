"""The views telemetry reads (:mod:`telemetry.views`), built from the policy, the pools and the pair gates.

Telemetry imports nothing from ``policies``, ``backends`` or ``gateway`` (docs/architecture.md, "Parts and layers"): this module
is the one place that turns a ``Policy``, the pools' ``PoolSnapshot``/``WorkerState`` and the ``GateBook``
(``gateway/gates/book.py``) into what telemetry exports, and hands it the closed label vocabularies (every
schema proposer, every exploration reason).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import get_args

import msgspec

from backends.sglang.pool import PoolSnapshot, WorkerState
from gateway.gates.book import GateBook, PoolGate, Region
from gateway.gates.values import GateEvent, Mismatch, Verdict
from policies.decide import EXPLORATIONS
from policies.schema import Policy, Proposer
from telemetry.views import (
    GateEventView, GateRegionView, GateVerdictView, GateView, PolicyView, PoolSpecView, PoolView, RouteView,
    SloView, WorkerView,
)

PROPOSERS = frozenset(get_args(Proposer))
EXPLORATION_KINDS = frozenset(EXPLORATIONS)


def policy_digest(policy: Policy) -> str:
    """Short sha256 of the canonical policy: the version shown until the gateway names one."""
    return hashlib.sha256(msgspec.json.encode(policy, order="sorted")).hexdigest()[:12]


def policy_view(policy: Policy) -> PolicyView:
    def slo(route: str) -> SloView:
        effective = policy.route_slo(route)
        return SloView(ttft_ms=effective.ttft_ms, tpot_ms=effective.tpot_ms)

    return PolicyView(
        digest=policy_digest(policy),
        routes=tuple(RouteView(name=name, slo=slo(name)) for name in policy.route_names()),
        slices=tuple(s.name for s in policy.slices),
        rules=tuple(r.name for r in policy.rules),
        pools=tuple(PoolSpecView(name=name, proposer=p.proposer, k_range=p.k_range, workers=tuple(p.workers))
                    for name, p in policy.pools.items()),
        proposers=PROPOSERS,
        explorations=EXPLORATION_KINDS,
        load_buckets=tuple(sorted(set(policy.learning.concurrency_buckets))),
    )


def worker_view(worker: WorkerState) -> WorkerView:
    load = worker.load
    return WorkerView(url=worker.url, healthy=worker.healthy, last_error=worker.last_error,
                      running=load.running if load else None, waiting=load.waiting if load else None,
                      kv_usage=load.token_usage if load else None, mismatches=tuple(worker.mismatches))


def pool_views(snapshots: Mapping[str, PoolSnapshot],
               workers: Mapping[str, Sequence[WorkerState]] | None = None) -> list[PoolView]:
    """One view per snapshot (keyed by pool name), with that pool's workers from ``workers``."""
    return [PoolView(name=name, workers=snap.workers, healthy_workers=len(snap.healthy_workers),
                     running=snap.running, waiting=snap.waiting, in_flight=snap.in_flight, kv_usage=snap.kv_usage,
                     accept_length=snap.accept_length, pair_verified=snap.pair_verified,
                     worker_states=tuple(worker_view(w) for w in (workers or {}).get(name, ())))
            for name, snap in snapshots.items()]


# -- the pair gates ----------------------------------------------------------------------------------

SERVING_STATES = ("passed", "degraded")  # the states in which a pool serves (policies.decide's safety)


def gate_event_view(event: GateEvent) -> GateEventView:
    return GateEventView(at=event.at, pool=event.pool, key=event.key, gate=event.gate, state=event.state,
                         previous=event.previous, reason=event.reason)


def mismatch_text(mismatch: Mismatch) -> str:
    """"canary code-1, output position 3: speculative token 42, plain token 17" (None: the output ended)."""
    def token(value: int | None) -> str:
        return "(output ended)" if value is None else f"token {value}"

    return (f"canary {mismatch.canary}, output position {mismatch.position}: speculative "
            f"{token(mismatch.speculative)}, plain {token(mismatch.plain)}")


def verdict_view(verdict: Verdict) -> GateVerdictView:
    return GateVerdictView(passed=verdict.passed, error=verdict.error, reason=verdict.reason,
                           canaries=verdict.canaries, tokens=verdict.tokens, accept_length=verdict.accept_length,
                           sampled_p=verdict.sampled_p, seconds=verdict.seconds,
                           mismatch=mismatch_text(verdict.mismatch) if verdict.mismatch else None,
                           worker=verdict.worker)


def _region_view(slice_: str, bucket: int, region: Region, share: float, now: float) -> GateRegionView:
    until = region.closed_until
    return GateRegionView(slice=slice_, bucket=bucket, share=share,
                          closed_for_s=round(until - now, 1) if until is not None and now < until else None,
                          steps=region.steps, last=region.last, window_speculative=len(region.spec),
                          window_plain=len(region.plain))


def gate_view(book: GateBook, gate: PoolGate, now: float) -> GateView:
    """One pool's gates. A region's ``share`` is the one decisions read (``GateBook.pool_state``): 0 where the
    region is closed, the initial share again once its closure expired, and 0 everywhere while the pool is
    pending or failed (it serves no user request then)."""
    _, ramp, _ = book.pool_state(gate.pool, now)
    serving = gate.state in SERVING_STATES
    regions = tuple(_region_view(s, b, region, ramp.get(f"{s}|{b}", region.share) if serving else 0.0, now)
                    for (s, b), region in sorted(gate.regions.items()))
    return GateView(pool=gate.pool, state=gate.state, key=gate.key, reason=gate.reason, since=gate.since,
                    running=gate.running, collapses=gate.collapses,
                    verdict=verdict_view(gate.verdict) if gate.verdict else None, regions=regions,
                    history=tuple(gate_event_view(e) for e in gate.history))


def gate_views(book: GateBook, now: float) -> dict[str, GateView]:
    """Every gated pool's view, by pool name. ``now``: ``time.monotonic()``, the book's clock for closures."""
    return {name: gate_view(book, book.pools[name], now) for name in sorted(book.pools)}
