"""What telemetry reads of the policy and the pools: small immutable views the gateway builds and hands in.

Telemetry imports nothing from ``policies`` or ``backends`` (docs/architecture.md, "Parts and layers"; tests/test_layout.py
checks it): the gateway turns its ``Policy`` into a ``PolicyView`` on every (re)load and its pools'
snapshots and worker states into ``PoolView``s on every push, and its pair gates into ``GateView``s and
``GateEventView``s (``gateway/telemetry_views.py``). A view holds exactly the fields telemetry exports or
shows, so a change to the policy schema, the pool or the gate internals reaches telemetry only through that
one builder.
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


class GateEventView(_View):
    """One change recorded by the pair gates (``gateway.gates.book.GateEvent``): the pool's state after it,
    the one before (None: the pool's first event) and why. ``gate``: equivalence | serving | outcome |
    collapse | version. A serving event can leave the state as it was (a load region opened or closed)."""

    at: float  # wall clock (time.time())
    pool: str
    key: str  # the pair version the pool's gates ran for
    gate: str
    state: str
    previous: str | None
    reason: str


class GateRegionView(_View):
    """The serving gate's ramp in one load region (slice x concurrency bucket index) of one pool."""

    slice: str
    bucket: int  # index into the learner's concurrency buckets (``PolicyView.load_buckets``)
    share: float  # of the policy's requests for the pool that this region now sends it (0: closed)
    closed_for_s: float | None  # seconds until a closed region ramps again; None: open or ramping
    steps: int  # windows judged so far
    last: str  # the last window's figures and verdict ("" before the first)
    window_speculative: int = 0  # requests in the window being collected, on each side
    window_plain: int = 0


class GateVerdictView(_View):
    """The last run of a pool's equivalence gate. ``error``: it could not finish (not a verdict on the
    pair); ``mismatch``: where a canary's greedy output first differed from plain, as text."""

    passed: bool
    error: bool
    reason: str
    canaries: int
    tokens: int  # greedy output tokens compared
    accept_length: float | None
    sampled_p: float | None  # the sampled check's smallest per-position p-value; None: not run
    seconds: float
    mismatch: str | None = None
    worker: str = ""


class GateView(_View):
    """One pool's pair gates: its state (pending | passed | failed | degraded), why and since when, the last
    equivalence verdict, the ramp per load region and the last state changes (oldest first)."""

    pool: str
    state: str
    key: str
    reason: str
    since: float  # wall clock of the last state change
    running: bool  # an equivalence run is in flight
    collapses: int  # acceptance collapses caught since the pair version passed
    verdict: GateVerdictView | None
    regions: tuple[GateRegionView, ...] = ()
    history: tuple[GateEventView, ...] = ()
