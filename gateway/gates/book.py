"""The pair gates' memory: one ``PoolGate`` per pool, its state machine, and the evidence behind each verdict.

    (new pair version) -> pending --equivalence passes--> passed --collapse--> degraded
                             |  ^                           | ^                  |
                   fails     v  | worker error: retry       | +--window fine-----+
                          failed                            +--outcome regresses--> failed
                             degraded, unserved for recheck_s -> pending (canaries again)

A pool's *key* is its declared pair version plus a digest of the identities its healthy workers report
(``gateway.backend.Backend.pool_keys``): a policy edit of the pair, or a worker restarted with other weights or
draft settings, is a new key, and a new key starts ``pending`` again. Pending and failed pools serve no user
request (``policies.decide``'s built-in safety); degraded ones are the policy's call (``pair_gate``). After
equivalence, each load region (slice x concurrency bucket) ramps (``Serving``); the pool's outcomes (task
success reported by applications) are compared per route with plain (``OutcomeCheck``); its live accept
length is compared with its baseline (``Collapse``). Every state change is one ``GateEvent``, which the
gateway logs and counts (``drain``).

No I/O and no statistics here: the gateway runs the canaries (``canary.py``) and hands verdicts and samples in,
with the time; the tests behind each verdict are ``judge.py``'s (SciPy: policies/ stays dependency-free).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from gateway.gates import judge
from gateway.gates.values import GateEvent, Sample, Verdict
from policies.schema import Gates, GateState, OutcomeCheck

HISTORY = 20  # state changes kept per pool (the admin view and the dashboard show them)


@dataclass(slots=True)
class Region:
    """The serving gate in one load region of one pool."""

    share: float
    closed_until: float | None = None
    spec: list[Sample] = field(default_factory=list)
    plain: list[Sample] = field(default_factory=list)
    steps: int = 0
    last: str = ""  # the last window's figures and verdict


@dataclass(slots=True)
class Window:
    """Accept-length evidence of one (pool, slice): recent requests' rounds, and the slice's baseline."""

    recent: deque[tuple[int, int, tuple[int, ...]]] = field(default_factory=deque)
    rounds: int = 0
    baseline: tuple[float, tuple[int, ...]] | None = None  # (accept length, histogram) of the first full window


@dataclass(slots=True)
class Arm:
    """Outcome reports of one arm (a pool's speculative requests, or a route's plain ones)."""

    scores: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    def add(self, score: float, tokens: int, seconds: float) -> None:
        self.scores.append(score)
        self.tokens += tokens
        self.seconds += seconds

    def view(self) -> dict[str, float | int | None]:
        n, wins = len(self.scores), sum(self.scores)
        return {"reports": n, "success_rate": wins / n if n else None,
                "tokens_per_success": self.tokens / wins if wins else None,
                "seconds_per_success": self.seconds / wins if wins else None}


@dataclass(slots=True)
class PoolGate:
    pool: str
    key: str
    state: GateState = "pending"
    reason: str = "new pair version: the equivalence gate has not run yet"
    since: float = 0.0
    running: bool = False
    retry_at: float = 0.0
    verdict: Verdict | None = None
    first_verdict: Verdict | None = None  # the one the key first passed with (the canary baseline)
    last_served: float = 0.0
    regions: dict[tuple[str, int], Region] = field(default_factory=dict)
    windows: dict[str, Window] = field(default_factory=dict)
    outcomes: dict[str, Arm] = field(default_factory=dict)  # route -> this pool's speculative requests
    collapses: int = 0
    recheck_floor: bool = False  # an operator re-check of a degraded pool: its canaries must still clear the floor
    collapsed: set[str] = field(default_factory=set)  # the slices whose windows hold the pool degraded
    history: deque[GateEvent] = field(default_factory=lambda: deque(maxlen=HISTORY))


class GateBook:
    """Not thread-safe (the gateway's event loop). ``settings`` None: no gate runs (every method is inert)."""

    def __init__(self, settings: Gates | None) -> None:
        self.settings = settings
        self.pools: dict[str, PoolGate] = {}
        self.plain_outcomes: dict[str, Arm] = {}  # route -> its plain requests' reports
        self._served: OrderedDict[str, tuple[Sample, float]] = OrderedDict()  # request id -> (sample, at)
        self._reported: set[str] = set()
        self._events: list[GateEvent] = []

    def configure(self, settings: Gates | None) -> None:
        """A policy reload: new settings; pools whose key is unchanged keep their state and evidence."""
        self.settings = settings
        if settings is None:
            self.pools.clear()

    # -- state -------------------------------------------------------------------------------------

    def _move(self, gate: PoolGate, state: GateState, which: str, reason: str, wall: float) -> None:
        event = GateEvent(at=wall, pool=gate.pool, key=gate.key, gate=which, state=state,
                          previous=gate.state if gate.history else None, reason=reason)
        if which != "serving":  # a region's ramp event leaves the pool's state, its reason and since alone
            gate.state, gate.reason, gate.since = state, reason, wall
        gate.history.append(event)
        self._events.append(event)

    def drain(self) -> list[GateEvent]:
        """State changes since the last call (the gateway logs and counts each once)."""
        events, self._events = self._events, []
        return events

    def sync(self, keys: dict[str, str | None], now: float, wall: float) -> None:
        """The pools the policy declares with a pair, and each one's current key (None: its workers'
        identity is not known yet, e.g. none is healthy: the pool keeps the key it had)."""
        if self.settings is None:
            return
        for name in [n for n in self.pools if n not in keys]:
            del self.pools[name]
        for name, key in keys.items():
            gate = self.pools.get(name)
            if gate is None:
                gate = self.pools[name] = PoolGate(pool=name, key=key or "", since=wall, last_served=now)
                self._move(gate, "pending", "version", "pair version first seen" if key else
                           "waiting for the workers' pair identity", wall)
            elif key is not None and not gate.key:
                gate.key, gate.reason = key, "pair version first seen: the equivalence gate has not run yet"
            elif key is not None and key != gate.key:
                was = gate.key
                # the old state rides along only to be the event's ``previous``
                self.pools[name] = gate = PoolGate(pool=name, key=key, state=gate.state, since=wall,
                                                   last_served=now, history=gate.history)
                self._move(gate, "pending", "version", f"pair version changed ({was} -> {key}): "
                           "the equivalence gate runs again", wall)

    def due(self, now: float) -> list[str]:
        """Pools whose equivalence gate should run now: pending (first run, or retrying after an error) and
        degraded pools left unserved for ``collapse.recheck_s``."""
        if self.settings is None:
            return []
        out = []
        collapse = self.settings.collapse
        for name, gate in self.pools.items():
            if gate.running or not gate.key:
                continue
            unserved = collapse is not None and now - gate.last_served >= collapse.recheck_s
            if now >= gate.retry_at and (gate.state == "pending" or gate.state == "degraded" and unserved):
                out.append(name)
        return out

    def started(self, pool: str) -> str:
        """A run begins; returns the key it runs for (its verdict counts only if the key is still current)."""
        gate = self.pools[pool]
        gate.running = True
        return gate.key

    def finished(self, pool: str, key: str, verdict: Verdict, now: float, wall: float) -> None:
        gate = self.pools.get(pool)
        if gate is None or gate.key != key:
            return  # the pool changed version meanwhile: a new run is due for the new key
        gate.running = False
        gate.verdict = verdict
        assert self.settings is not None
        if verdict.error:
            gate.retry_at = now + self.settings.equivalence.retry_s
            gate.reason = f"equivalence gate could not run: {verdict.reason}; retrying"
            if gate.state == "degraded":
                gate.last_served = now  # wait another recheck_s
            return
        if not verdict.passed:
            self._move(gate, "failed", "equivalence", verdict.reason, wall)
            return
        collapsed = self._canaries_collapsed(gate, verdict)
        if collapsed is not None:  # a degraded pool's re-check: it stays degraded, and says why
            gate.retry_at = now + self.settings.equivalence.retry_s
            gate.last_served = now
            gate.reason = collapsed
            return
        gate.first_verdict = gate.first_verdict or verdict
        gate.recheck_floor = False
        gate.regions.clear()
        gate.windows.clear()
        gate.collapsed.clear()
        gate.last_served = now
        self._move(gate, "passed", "equivalence", verdict.reason, wall)

    def _canaries_collapsed(self, gate: PoolGate, verdict: Verdict) -> str | None:
        """A re-check of a degraded pool also needs its canaries to accept as a working pair does."""
        collapse = self.settings.collapse if self.settings else None
        first = gate.first_verdict
        rechecking = gate.state == "degraded" or gate.recheck_floor
        if (not rechecking or collapse is None or first is None or first.accept_length is None
                or verdict.accept_length is None or first.accept_length < collapse.min_baseline):
            return None
        if verdict.accept_length < collapse.floor:
            return (f"re-check: canaries accept {verdict.accept_length:.2f} per round (< floor {collapse.floor:g}; "
                    f"{first.accept_length:.2f} when the pair passed)")
        return None

    def force_recheck(self, pool: str, now: float, wall: float) -> bool:
        """Ops asked for the equivalence gate again (``POST /admin/pools/NAME/check``): back to pending."""
        gate = self.pools.get(pool)
        if gate is None or gate.running:
            return False
        gate.retry_at = now
        gate.recheck_floor = gate.recheck_floor or gate.state == "degraded"
        self._move(gate, "pending", "equivalence", "re-check requested by an operator", wall)
        return True

    # -- the live gates ------------------------------------------------------------------------------

    def observe(self, sample: Sample, now: float, wall: float) -> None:
        """One finished user request: ramp evidence, collapse windows, and the request's id for outcomes."""
        if self.settings is None:
            return
        outcome = self.settings.outcome
        if outcome is not None and sample.ok:
            self._served[sample.request_id] = (sample, now)
            while len(self._served) > outcome.max_tracked or (
                    self._served and now - next(iter(self._served.values()))[1] > outcome.ttl_s):
                rid, _ = self._served.popitem(last=False)
                self._reported.discard(rid)
        if sample.resumed:  # not a timing or acceptance sample of either worker's pool (Sample.resumed)
            return
        if sample.pool is None:
            if not sample.ok:  # as on the speculative side: a failed request has no timings to compare
                return
            for gate in self.pools.values():
                region = gate.regions.get((sample.slice, sample.bucket))
                if (region is not None and region.share < 1.0 and region.closed_until is None
                        and gate.state in ("passed", "degraded")):
                    region.plain.append(sample)
                    del region.plain[:-self.settings.serving.window if self.settings.serving else None]
                    self._step(gate, sample.slice, sample.bucket, region, now, wall)
            return
        gate = self.pools.get(sample.pool)
        if gate is None or gate.key != sample.key or gate.state not in ("passed", "degraded"):
            return
        gate.last_served = now
        serving = self.settings.serving
        if serving is not None and sample.ok:
            region = self._region(gate, sample.slice, sample.bucket, now)
            if region.share < 1.0 and region.closed_until is None:
                region.spec.append(sample)
                del region.spec[:-serving.window]  # a window is the latest ``window`` of each side
                self._step(gate, sample.slice, sample.bucket, region, now, wall)
        if self.settings.collapse is not None and sample.verify_ct > 0:
            self._watch(gate, sample, wall)

    def _region(self, gate: PoolGate, slice_: str, bucket: int, now: float) -> Region:
        serving = self.settings.serving if self.settings else None
        assert serving is not None
        region = gate.regions.get((slice_, bucket))
        if region is None:
            region = gate.regions[(slice_, bucket)] = Region(share=serving.initial_share)
        if region.closed_until is not None and now >= region.closed_until:
            region.closed_until, region.share, region.spec, region.plain = None, serving.initial_share, [], []
        return region

    def _step(self, gate: PoolGate, slice_: str, bucket: int, region: Region, now: float, wall: float) -> None:
        """After ``window`` requests on each side: grow the share, open the region, or close it."""
        serving = self.settings.serving if self.settings else None
        if serving is None or len(region.spec) < serving.window or len(region.plain) < serving.window:
            return
        misses, figures = judge.serving_misses(serving, region.spec, region.plain)
        region.spec, region.plain, region.steps = [], [], region.steps + 1
        where = f"slice {slice_}, load bucket {bucket}"
        if misses:
            region.share, region.closed_until = 0.0, now + serving.retry_s
            region.last = f"closed: {'; '.join(misses)} ({figures})"
            self._move(gate, gate.state, "serving", f"{where} closed for {serving.retry_s:g} s: "
                       f"{'; '.join(misses)}", wall)
            return
        region.share = min(1.0, region.share * serving.growth)
        region.last = f"share -> {region.share:.2f} ({figures})"
        if region.share >= 1.0:
            self._move(gate, gate.state, "serving", f"{where} open ({figures})", wall)

    def _watch(self, gate: PoolGate, sample: Sample, wall: float) -> None:
        collapse = self.settings.collapse if self.settings else None
        assert collapse is not None
        window = gate.windows.setdefault(sample.slice, Window())
        window.recent.append((sample.verify_ct, sample.correct_drafts, sample.histogram))
        window.rounds += sample.verify_ct
        while len(window.recent) > 1 and window.rounds - window.recent[0][0] >= collapse.window_rounds:
            window.rounds -= window.recent.popleft()[0]
        if window.rounds < collapse.window_rounds:
            return
        rounds = window.rounds
        accept = (rounds + sum(c for _, c, _ in window.recent)) / rounds
        histogram = judge.sum_histograms(h for _, _, h in window.recent)
        if window.baseline is None:
            first = gate.first_verdict.accept_length if gate.first_verdict else None
            collapsed = judge.collapsed(collapse, accept, histogram, first, None)
            if collapsed is None:
                window.baseline = (accept, histogram)
        else:
            collapsed = judge.collapsed(collapse, accept, histogram, window.baseline[0], window.baseline[1])
        where = f"slice {sample.slice}: "
        # the pool is degraded while any slice's window is collapsed: a healthy window elsewhere clears nothing
        if collapsed is not None and sample.slice not in gate.collapsed:
            gate.collapsed.add(sample.slice)
            window.recent.clear()
            window.rounds = 0
            if gate.state == "passed":
                gate.collapses += 1
                self._move(gate, "degraded", "collapse", where + collapsed, wall)
        elif collapsed is None and gate.state == "degraded" and (sample.slice in gate.collapsed
                                                                 or not gate.collapsed):
            gate.collapsed.discard(sample.slice)
            window.recent.clear()
            window.rounds = 0
            if not gate.collapsed:
                self._move(gate, "passed", "collapse", f"{where}accept length {accept:.2f} per round over "
                           f"{rounds} rounds: recovered", wall)

    # -- outcomes ------------------------------------------------------------------------------------

    def report(self, request_id: str, route: str, score: float, now: float, wall: float) -> str | None:
        """An application's outcome for one of its finished requests. Returns None when taken, else why not
        (``unknown`` / ``reported`` / ``off``)."""
        outcome = self.settings.outcome if self.settings else None
        if outcome is None:
            return "off"
        entry = self._served.get(request_id)
        if entry is None or entry[0].route != route or now - entry[1] > outcome.ttl_s:
            return "unknown"  # another route's request is unknown to this one, as an expired one is
        if request_id in self._reported:
            return "reported"
        self._reported.add(request_id)
        self.report_sample(entry[0], score, wall)
        return None

    def served(self, request_id: str, route: str, now: float) -> Sample | None:
        """The gate sample of a request this gateway served for ``route`` within the outcome TTL (None: unknown
        here). A fleet replica claims its reports in the state store first (``gateway/fleet.py``)."""
        outcome = self.settings.outcome if self.settings else None
        entry = self._served.get(request_id)
        if outcome is None or entry is None or entry[0].route != route or now - entry[1] > outcome.ttl_s:
            return None
        return entry[0]

    def report_sample(self, sample: Sample, score: float, wall: float) -> None:
        """An outcome taken for ``sample`` (here, or by another replica of the fleet): its evidence for the outcome
        gate of its pool (a plain request's for every pool)."""
        outcome = self.settings.outcome if self.settings else None
        if outcome is None:
            return
        self._reported.add(sample.request_id)
        route = sample.route
        gate = self.pools.get(sample.pool) if sample.pool is not None else None
        if sample.pool is not None and (gate is None or gate.key != sample.key):
            return  # its pool has another pair version now: the report no longer bears on it
        arms = gate.outcomes if gate is not None else self.plain_outcomes  # a plain report bears on every pool
        arms.setdefault(route, Arm()).add(score, sample.completion_tokens, sample.seconds)
        for judged in [gate] if gate is not None else list(self.pools.values()):
            self._judge(judged, route, outcome, wall)

    def note(self, pool: str, reason: str) -> None:
        """Why a pool stays in its state (shown with it; no event): e.g. a pending pool no rule serves."""
        gate = self.pools.get(pool)
        if gate is not None:
            gate.reason = reason

    def postpone(self, pool: str, key: str, until: float, reason: str) -> None:
        """A due run this replica does not run now (another replica of the fleet holds its lease): due again at
        ``until`` (monotonic), unless the verdict arrived meanwhile."""
        gate = self.pools.get(pool)
        if gate is not None and gate.key == key:
            gate.running, gate.retry_at, gate.reason = False, until, reason

    def _judge(self, gate: PoolGate, route: str, outcome: OutcomeCheck, wall: float) -> None:
        spec, plain = gate.outcomes.get(route), self.plain_outcomes.get(route)
        if gate.state == "failed" or spec is None or plain is None:
            return
        p = judge.worse(spec.scores, plain.scores, outcome)
        if p is not None and p < outcome.alpha:
            s, b = spec.view(), plain.view()
            self._move(gate, "failed", "outcome", f"route {route}: success {s['success_rate']:.3f} over "
                       f"{s['reports']} reports vs plain {b['success_rate']:.3f} over {b['reports']} "
                       f"(worse by more than {outcome.max_drop:g}, p = {p:.2g} < {outcome.alpha:g})", wall)

    # -- what decisions and views read -------------------------------------------------------------

    def pool_state(self, pool: str, now: float) -> tuple[str | None, dict[str, float], float]:
        """(gate state, ramp shares by ``slice|bucket``, default share) for ``policies.snapshot.PoolState``."""
        gate = self.pools.get(pool)
        if gate is None or self.settings is None:
            return None, {}, 1.0
        serving = self.settings.serving
        if serving is None or gate.state not in ("passed", "degraded"):
            return gate.state, {}, 1.0
        # a closed region whose pause is over ramps again from the initial share (reset at its next sample)
        ramp = {f"{s}|{b}": r.share if r.closed_until is None
                else 0.0 if now < r.closed_until else serving.initial_share for (s, b), r in gate.regions.items()}
        return gate.state, ramp, serving.initial_share

    def view(self, pool: str, now: float) -> dict[str, object] | None:
        """The admin API's and the dashboard's view of one pool's gates."""
        gate = self.pools.get(pool)
        if gate is None:
            return None
        return {
            "state": gate.state, "key": gate.key, "reason": gate.reason, "since": gate.since,
            "running": gate.running, "verdict": gate.verdict, "collapses": gate.collapses,
            "regions": [{"slice": s, "bucket": b, "share": r.share, "steps": r.steps, "last": r.last,
                         "closed_for_s": round(r.closed_until - now, 1)
                         if r.closed_until is not None and now < r.closed_until else None,
                         "window": {"speculative": len(r.spec), "plain": len(r.plain)}}
                        for (s, b), r in sorted(gate.regions.items())],
            "accept": {s: {"rounds": w.rounds, "baseline": w.baseline[0] if w.baseline else None}
                       for s, w in sorted(gate.windows.items())},
            "outcomes": {route: {"speculative": arm.view(),
                                 "plain": self.plain_outcomes.get(route, Arm()).view()}
                         for route, arm in sorted(gate.outcomes.items())},
            "history": list(gate.history),
        }
