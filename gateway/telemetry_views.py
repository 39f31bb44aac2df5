"""The views telemetry reads (:mod:`telemetry.views`), built from the policy and the pools.

Telemetry imports nothing from ``policies`` or ``backends`` (DESIGN.md's layering): this module is the
one place that turns a ``Policy`` and the pools' ``PoolSnapshot``/``WorkerState`` into what telemetry
exports, and hands it the closed label vocabularies (every schema proposer, every exploration reason).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import get_args

import msgspec

from backends.sglang.pool import PoolSnapshot, WorkerState
from policies.decide import EXPLORATIONS
from policies.schema import Policy, Proposer
from telemetry.views import PolicyView, PoolSpecView, PoolView, RouteView, SloView, WorkerView

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
