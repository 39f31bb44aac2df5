"""Who serves a simulated request: a fixed option (an arm), or a policy through the gateway's real code.

:class:`PolicyChooser` runs ``policies.decide.decide`` on snapshots of a real ``policies.stats.LearningState``
at the simulated time, rebuilt as ``gateway/state.py`` rebuilds them (at most every ``snapshot_max_age_s``,
sooner after an outcome), counts explorations in flight as the gateway does, and feeds the learner the
``Outcome`` the gateway would build (``gateway/stages.outcome``: streamed, so TTFT and TPOT; the mean
concurrency over the request's life; the worker's per-position counts). Policies are pure, so this is the
code that runs in production, on another clock. Each pool's worker URL is one simulated worker; pools that
name the same URL share it (the default policy's three pools are one embedded worker).

:class:`Prices` turns (request, option) into a :class:`~replay.profile.Profile`, memoized for the
exact options and recomputed per run for suffix (its tree depends on the order) and for sampled requests
(drawn per run, labelled estimated).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from backends.engine.types import SuffixSettings
from replay.book import PLAIN, Option, RoundBook
from replay.hybrid import HybridWalker, suffix_positions
from replay.profile import CachedCosts, Profile, profile
from replay.walk import Walker, drawn_positions
from policies.compiled import compiled
from policies.decide import decide, exploration_key
from policies.snapshot import PoolState, load_concurrency
from policies.shared_sums import Merger, sum_counts
from policies.stats import LearningState, Outcome, with_counterfactuals
from replay.evidence import EVALUATED, Counterfactuals


@dataclass(frozen=True, slots=True)
class Choice:
    """What served a request: the option's label (``plain``, ``ngram-k4``), and for a policy its decision."""

    option: Option
    pool: str = ""
    rule: str = ""
    slice: str = ""  # the policy's slice (the trace's own label is the request's)
    exploration: str | None = None
    exploring: str | None = None  # policies.decide.exploration_key of the decision (counted in flight)
    estimated: bool = False
    counterfactual: tuple = ()  # the decision's full-information options (policies.auto.counterfactual_options)
    worker: str = ""
    replica: int = 0  # which gateway of a simulated fleet decided it (PolicyChooser's ``replicas``)

    @property
    def label(self) -> str:
        return self.option.label


class Prices:
    """Profiles of (request, option) on one cost model, and the simulated workers' settings as the worker's
    flags name them: ``context_length`` caps the KV reservation as ``Sequence.reserved_tokens`` does;
    ``prefill_chunk`` and ``max_batch_tokens`` shape every engine step (replay/sim.py)."""

    def __init__(self, book: RoundBook, costs, prefill_chunk: int = 256, context_length: int = 8192,
                 per_worker: dict | None = None, max_batch_tokens: int = 512) -> None:
        self.book, self.costs = book, CachedCosts(costs)
        self.per_worker = {url: CachedCosts(model) for url, model in (per_worker or {}).items()}
        self.prefill_chunk, self.context_length = prefill_chunk, context_length
        self.max_batch_tokens = max_batch_tokens
        self._memo: dict[tuple[int, Option, int], Profile] = {}
        self.evidence_memo: dict = {}  # full-information prices (replay/evidence.py), shared by every run
        # suffix profiles of a fixed arm under the stream order that filled its tree (RunState.order), for the
        # last order only: a sweep runs one seed's loads together (run.sweep), and older orders are not asked again
        self._suffix: dict[tuple, Profile] = {}
        self._suffix_order: object = None

    def costs_of(self, worker: str):
        """The cost model of a worker (``--costs URL=FILE``), else the default one."""
        return self.per_worker.get(worker, self.costs)

    def reserve(self, i: int, option: Option) -> int:
        r = self.book.requests[i]
        return min(len(r.prompt_ids) + r.sampling.max_new_tokens, self.context_length) + option.k + 1

    def profile(self, i: int, option: Option, run: RunState) -> tuple[Profile, bool]:
        """(profile, estimated). Exact and memoized unless suffix or a sampled request."""
        r = self.book.requests[i]
        costs = self.costs_of(run.worker_of)
        estimated = not r.sampling.greedy
        if option.strategy or option.proposer == "hybrid":  # hybrid's rule learns across requests: walked
            return self.walker(i, option, run), estimated
        if estimated and option.proposer != "none":
            rounds = self.book.estimated_rounds(i, option, run.rng)
        elif option.proposer == "suffix":
            if run.order != self._suffix_order:
                self._suffix.clear()
                self._suffix_order = run.order
            key = (run.worker_of, i, option)
            hit = self._suffix.get(key) if run.order is not None else None
            if hit is None:
                rounds = self.book.suffix_rounds(i, option, run.suffix_store(run.worker_of))
                hit = profile(costs, len(r.prompt_ids), len(r.output_ids), option, rounds)
                if run.order is not None:
                    self._suffix[key] = hit
            return hit, estimated
        else:
            key = (i, option, id(costs))
            hit = self._memo.get(key)
            if hit is None:
                hit = self._memo[key] = profile(costs, len(r.prompt_ids), len(r.output_ids), option,
                                                self.book.rounds(i, option))
            return hit, estimated
        return profile(costs, len(r.prompt_ids), len(r.output_ids), option, rounds), estimated


    def walker(self, i: int, option: Option, run: RunState):
        """A :class:`~replay.walk.Walker` for a per-round option (its controller seeded per run and
        request); a sampled request's per-position runs are drawn from its slice's rates."""
        r = self.book.requests[i]
        n = len(r.output_ids)
        if option.proposer == "hybrid":
            return self._hybrid_walker(i, option, run)
        if r.sampling.greedy:
            lens, runs, matches = self.book.positions(i, option)
        else:
            rates = self.book.position_rates(r.slice, Option(option.proposer, option.k, option.pair))
            lens, runs = drawn_positions(rates, n, run.rng)
            matches = [0] * n
        seed = random.Random(f"controller:{run.seed}:{i}").getrandbits(63)
        informed = option.strategy == "informed"
        return Walker(self.costs_of(run.worker_of), len(r.prompt_ids), n, r.sampling.max_new_tokens, option,
                      lens, runs, matches, seed, self.book.context_rates(option.features) if informed else None,
                      self.book.feature_keys(i, option.features) if informed else None)

    def _hybrid_walker(self, i: int, option: Option, run: RunState):
        """A :class:`~replay.hybrid.HybridWalker`: both sources' drafts per position, suffix's from the run's
        store in admission order; a sampled request's runs are drawn from its slice's rates of each source."""
        r = self.book.requests[i]
        n, max_new = len(r.output_ids), r.sampling.max_new_tokens
        if r.sampling.greedy:
            *ngram, firsts = self.book.ngram_scan(i)
            suffix, agrees = suffix_positions(run.suffix_store(run.worker_of), r.route, r.prompt_ids, r.output_ids,
                                              max_new, option.k, firsts)
        else:  # drawn runs: the drafts' tokens, and so their agreement, are not known
            ngram, suffix = ((*drawn_positions(self.book.position_rates(r.slice, Option(source, option.k)), n, run.rng),
                              [0] * n) for source in ("ngram", "suffix"))
            agrees = []
        seed = random.Random(f"controller:{run.seed}:{i}").getrandbits(63)
        return HybridWalker(self.costs_of(run.worker_of), len(r.prompt_ids), n, max_new, option, ngram, suffix, seed,
                            agrees)


class RunState:
    """What one simulation run owns: the rng of estimated rounds and one suffix store per worker."""

    def __init__(self, seed: int, order: object = None) -> None:
        """``order``: a key of the stream order when every request reaches the suffix tree in that order
        whatever the load (a fixed arm under closed-loop or Poisson arrivals: the worker admits FIFO in
        arrival order), so its suffix rounds are shared between loads; None when they cannot be."""
        self.order, self.seed = order, seed
        self.rng = random.Random(f"estimated:{seed}")
        self._stores: dict[str, object] = {}
        self.worker_of = ""

    def remember(self, worker: str, scope: str, prompt: list[int], output: list[int]) -> None:
        """An answer not served by suffix decoding joins ``worker``'s tree once that worker drafts from one
        (``Engine._finish``); at admission, as suffix's own answers do here."""
        store = self._stores.get(worker)
        if store is not None:
            store.remember(scope, list(prompt), list(output))

    def suffix_store(self, worker: str):
        store = self._stores.get(worker)
        if store is None:
            from backends.engine.proposers.suffix import SuffixStore  # torch (~2 s): the gateway loads replay

            store = self._stores[worker] = SuffixStore(SuffixSettings())  # the worker's defaults
        return store


class FixedChooser:
    """Every request served by one option on one worker (an arm of the serving benchmark)."""

    plain_estimates = False  # learns nothing: the simulator need not price a plain counterfactual

    def __init__(self, option: Option, prices: Prices, seed: int, order: object = None) -> None:
        prices.book.check(option)
        self.option, self.prices, self.run = option, prices, RunState(seed, order=order)
        self.worker = "worker"
        self.run.worker_of = self.worker
        # one Choice per kind, shared by the requests (a worker process pickles each shared object once)
        self._choices = {flag: Choice(option, estimated=flag) for flag in (False, True)}

    def workers(self) -> list[str]:
        return [self.worker]

    def choose(self, i: int, t: float, sim) -> tuple[Choice, str, Profile, int]:
        prof, estimated = self.prices.profile(i, self.option, self.run)
        return self._choices[estimated], self.worker, prof, self.prices.reserve(i, self.option)

    def finished(self, served, prof: Profile, t: float, sim) -> None:
        pass


@dataclass(eq=False)
class _Replica:
    """One gateway's learner, its explorations in flight and its snapshot cache (a fleet has several)."""

    learning: LearningState
    exploring: dict[str, int] = field(default_factory=dict)  # its own explorations in flight
    remote: dict[str, int] = field(default_factory=dict)  # the other replicas', as of the last sync
    merger: Merger = field(default_factory=Merger)  # the other replicas' sums, as of the last sync
    snapshot: object = None
    at: float = float("-inf")
    dirty: bool = False

    def fleet_exploring(self) -> dict[str, int]:
        """Explorations in flight as its decisions see them: its own plus the others' (gateway/state.py)."""
        return sum_counts(self.exploring, self.remote) if self.remote else self.exploring


class PolicyChooser:
    """A policy file, deciding with the gateway's real ``decide()`` and learning as the gateway learns."""

    plain_estimates = True  # its outcomes carry the worker's plain counterfactual (Served.plain_ratio)

    def __init__(self, policy, prices: Prices, seed: int, snapshot_max_age_s: float = 0.1,
                 without_flags: str = "refuse", replicas: int = 1, sync_s: float | None = None) -> None:
        """``without_flags``: what to do with a draft_model pool whose pair the trace has no match flags for
        (a recorded trace has none): "refuse" (an error naming the fix), or "exclude" (the pool is
        unhealthy in every simulated snapshot, so decide() never picks it: :attr:`excluded` names them).
        ``replicas``: a fleet of that many gateways, each with its own learner, taking requests in turn (round
        robin); ``sync_s``: they share their sums and explorations in flight as gateway/fleet.py does, each
        seeing the others' as of the sync before last (the staleness bound: two sync intervals), or None: they
        share nothing (a fleet without a state store)."""
        self.policy, self.prices = policy, prices
        self.run = RunState(seed)
        self.rng = random.Random(seed)
        self.replicas = [_Replica(LearningState(policy.learning)) for _ in range(replicas)]
        self.sync_s = sync_s if replicas > 1 else None
        self._turn, self._next_sync = 0, 0.0
        self._published: list[tuple[dict, dict]] = [({}, {})] * replicas
        self.evidence = Counterfactuals(prices.book.ngram)  # decisions name the options (learning.counterfactual)
        self.pair_versions = compiled(policy).pair_versions
        self.max_age = snapshot_max_age_s
        header = prices.book.trace.header
        self.excluded: list[str] = []
        for name, pool in policy.pools.items():
            if pool.adaptive and pool.proposer not in ("ngram", "draft_model", "hybrid"):
                raise ValueError(f"pool {name}: a per-round draft length replays with ngram, draft_model and hybrid, "
                                 f"not {pool.proposer} (its drafts depend on the order of requests)")
            pair = policy.pairs.get(pool.pair) if pool.pair else None
            if pool.proposer == "draft_model" and pair is not None:
                if without_flags == "exclude" and self.pair_versions[name] not in header.pairs:
                    self.excluded.append(name)
                    continue
                prices.book.check(Option("draft_model", 1, self.pair_versions[name]))
        self._verified = {name: self._pair_ok(name, header.revision) for name in policy.pools}

    def _pair_ok(self, name: str, revision: str) -> bool | None:
        pool = self.policy.pools[name]
        pair = self.policy.pairs.get(pool.pair) if pool.pair else None
        if pair is None:
            return True if pool.proposer == "none" else None
        return pair.target.revision in (None, revision)

    def workers(self) -> list[str]:
        return list(dict.fromkeys(url for pool in self.policy.pools.values() for url in pool.workers))

    def _pools(self, sim) -> dict[str, PoolState]:
        states = {}
        for name, pool in self.policy.pools.items():
            running = waiting = 0
            usage = 0.0
            for url in pool.workers:
                s = sim.workers[url].scheduler
                running += len(s.running)
                waiting += len(s.waiting) + len(sim.workers[url].inbox)
                usage = max(usage, s.reserved / s.max_total_tokens)
            states[name] = PoolState(healthy=name not in self.excluded, pair_verified=self._verified[name], running=running,
                                     waiting=waiting, kv_usage=usage, workers_healthy=len(pool.workers))
        return states

    @property
    def learning(self) -> LearningState:
        """The learner (of the first gateway, in a fleet)."""
        return self.replicas[0].learning

    def snapshot(self, t: float, sim, replica: int = 0):
        """What ``replica`` decides from at ``t``, rebuilt as gateway/state.py rebuilds it."""
        r = self.replicas[replica]
        age = t - r.at
        if r.snapshot is None or age >= self.max_age or (r.dirty and age >= self.max_age / 2):
            pools = self._pools(sim)
            snap = r.learning.snapshot(t, pools, load_concurrency(sim.in_flight, pools))
            r.snapshot = r.merger.snapshot(snap, r.learning.tables())
            r.at, r.dirty = t, False
        return r.snapshot

    def _sync(self, t: float) -> None:
        """The fleet's sync rounds due by ``t``: each replica publishes its own sums and explorations in flight,
        and takes the others' published a round earlier (policies/shared_sums.Merger, as gateway/fleet.py)."""
        if self.sync_s is None or t < self._next_sync:
            return
        due = int((t - self._next_sync) // self.sync_s) + 1
        if due > 2:  # the learners have not changed since the last event: the rounds before the last two change nothing
            self._next_sync += (due - 2) * self.sync_s
        while t >= self._next_sync:
            before = self._published
            self._published = [({table: dict(keys) for table, keys in r.learning.tables().items()},
                                dict(r.exploring)) for r in self.replicas]
            for n, r in enumerate(self.replicas):
                others = [tables for m, (tables, _) in enumerate(before) if m != n]
                r.merger.set_others(others, self.policy.learning.half_life_s)
                r.remote = sum_counts(*(exploring for m, (_, exploring) in enumerate(before) if m != n))
            self._next_sync += self.sync_s

    def choose(self, i: int, t: float, sim) -> tuple[Choice, str, Profile, int]:
        request = self.prices.book.requests[i]
        self._sync(t)
        n = self._turn % len(self.replicas)
        self._turn += 1
        r = self.replicas[n]
        d = decide(self.policy, request.features, self.snapshot(t, sim, n), rng=self.rng,
                   exploring=r.fleet_exploring())
        key = exploration_key(d)
        if key is not None:
            r.exploring[key] = r.exploring.get(key, 0) + 1
        option = PLAIN
        if not d.bypass and d.proposer != "none" and d.draft_tokens > 0:
            pair = self.pair_versions.get(d.pool, "") if d.proposer == "draft_model" else ""
            pool = self.policy.pools[d.pool]
            option = (Option(d.proposer, d.draft_tokens, pair, strategy=pool.strategy, table=pool.batch_table)
                      if pool.adaptive else Option(d.proposer, d.draft_tokens, pair))
        urls = self.policy.pools[d.pool].workers
        url = min(urls, key=lambda u: len(sim.workers[u].scheduler.running) + len(sim.workers[u].scheduler.waiting))
        self.run.worker_of = url
        prof, estimated = self.prices.profile(i, option, self.run)
        if option.proposer not in ("suffix", "hybrid"):  # those feed the tree themselves
            self.run.remember(url, request.route, request.prompt_ids, request.output_ids)
        choice = Choice(option, pool=d.pool, rule=d.rule, slice=d.slice, exploration=d.exploration,
                        exploring=key, estimated=estimated, counterfactual=d.counterfactual, worker=url, replica=n)
        return choice, url, prof, self.prices.reserve(i, option)

    def finished(self, served, prof: Profile, t: float, sim) -> None:
        c: Choice = served.choice
        request = self.prices.book.requests[served.index]
        self._sync(t)  # the rounds before this outcome publish what the learners held before it
        r = self.replicas[c.replica]
        key = c.exploring
        if key is not None:
            n = r.exploring.get(key, 0) - 1
            if n > 0:
                r.exploring[key] = n
            else:
                r.exploring.pop(key, None)
        speculative = c.option.proposer != "none"
        outcome = Outcome(
            route=request.route, slice=c.slice, pool=c.pool, pair_version=self.pair_versions.get(c.pool, ""),
            proposer=c.option.proposer, draft_tokens=c.option.k,
            completion_tokens=prof.tokens, verify_ct=prof.verify_ct, correct_drafts_histogram=list(prof.histogram),
            accepted_per_position=list(prof.accepted_per_position) if speculative else None,
            reached_per_position=list(prof.reached_per_position) if speculative else None,
            ttft_s=served.ttft, tpot_s=served.tpot, e2e_s=served.e2e, concurrency=round(served.concurrency),
            draft_s=prof.draft_s, verify_s=prof.verify_s, timestamp=t,
            prompt_repeat=request.features.prompt_repeat,
            plain_tpot_s=served.tpot * served.plain_ratio
            if speculative and served.tpot and served.plain_ratio else None,
            neighbour_tpot_s=served.neighbour_s / (prof.tokens - 1)
            if speculative and served.neighbour_s and prof.tokens >= 2 else 0.0)
        if c.counterfactual and request.sampling.greedy:
            # full information, as the gateway learns it (gateway/evidence.py)
            option = c.option
            own = (option.proposer, option.k) if option.proposer in EVALUATED and not option.strategy else None
            ratios, own_ratio = self.evidence.ratios(
                self.prices.costs_of(c.worker), request.prompt_ids, request.output_ids,
                request.sampling.max_new_tokens, request.route, round(served.concurrency), c.counterfactual, own,
                ngram_rounds=lambda k: self.prices.book.rounds(served.index, Option("ngram", k)),
                memo=self.prices.evidence_memo)
            outcome = with_counterfactuals(outcome, ratios, own_ratio)
        r.learning.record(outcome)
        r.dirty = True
