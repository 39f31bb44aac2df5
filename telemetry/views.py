"""What telemetry reads of the policy and the pools: small immutable views the gateway builds and hands in.

Telemetry imports nothing from ``policies`` or ``backends`` (DESIGN.md's layering; tests/test_layout.py
checks it): the gateway turns its ``Policy`` into a ``PolicyView`` on every (re)load and its pools'
snapshots and worker states into ``PoolView``s on every push (``gateway/telemetry_views.py``). A view
holds exactly the fields telemetry exports or shows, so a change to the policy schema or the pool
internals reaches telemetry only through that one builder.
"""

from __future__ import annotations

import msgspec


class _View(msgspec.Struct, frozen=True, kw_only=True):
    pass


class SloView(_View):
    """A route's effective SLO (its own fields over the policy's default); None: not set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


class RouteView(_View):
    name: str
    slo: SloView


class PoolSpecView(_View):
    """One pool as the policy configures it."""

    name: str
    proposer: str
    k_range: tuple[int, int]  # (min, max) draft tokens; (0, 0) for proposer none
    workers: tuple[str, ...]  # worker URLs, the only ones exported as a ``worker`` label


class PolicyView(_View):
    """The policy in force, as labels and the dashboard need it.

    ``proposers`` and ``explorations`` are the closed vocabularies of the ``proposer`` and exploration
    ``kind`` labels (every proposer the policy schema knows, every reason the auto decision explores
    for); the gateway passes them in so a value outside them is exported as ``other``, and the number of
    series stays bounded by this view whatever the traffic."""

    digest: str  # short hash of the canonical policy: the version shown until the gateway names one
    routes: tuple[RouteView, ...]  # in policy order (one named "default" when the policy names none)
    slices: tuple[str, ...]  # slice names in policy order (a name may repeat)
    rules: tuple[str, ...]  # rule names in policy order
    pools: tuple[PoolSpecView, ...]  # in policy order
    proposers: frozenset[str]
    explorations: frozenset[str]
    # the learner's concurrency bucket edges (``learning.concurrency_buckets``), ascending: the load buckets of
    # the dashboard's speedup table
    load_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


class WorkerView(_View):
    """One worker as its pool last saw it; ``running``/``waiting``/``kv_usage`` are None until a load
    poll answered."""

    url: str
    healthy: bool
    last_error: str | None = None
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # 0-1
    mismatches: tuple[str, ...] = ()  # pair identity fields that differ from the policy's pair


class PoolView(_View):
    """One pool's latest state, with the workers it holds."""

    name: str
    workers: int  # configured
    healthy_workers: int
    running: int
    waiting: int
    in_flight: int  # requests the gateway has in flight to the pool
    kv_usage: float | None
    accept_length: float | None
    pair_verified: bool | None  # None: unknown (no identity yet, or no pair)
    worker_states: tuple[WorkerView, ...] = ()
