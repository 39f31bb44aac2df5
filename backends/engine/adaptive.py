"""Per-round draft length: the engine asks a controller for k before every round of a speculating sequence.

Three controllers, chosen per request (``SpeculationParams.strategy``), one interface: ``choose(batch)``
returns the round's k (``batch``: sequences running in this engine step), ``observe(proposed, accepted)``
reports the round, ``end_step()`` closes an engine step.

``beta`` (:class:`BetaDraftLength`, specgate's own, per sequence). Model: draft position j of a round is
accepted, given drafts 1..j-1 were, with an unknown probability a_j(c) that depends on the round's context c:
for n-gram the length of the context suffix that found the draft (:func:`match_context`: a longer match is
accepted far more often), one context for the other proposers. An n-gram draft costs microseconds and the draft for k is a prefix of the draft for more,
so the engine drafts first and the controller picks k <= the drafts found, knowing c. The posterior of each
a_j(c) is Beta(alpha, beta) with pseudo-counts from three levels: the prior the gateway sends
(``SpeculationParams.prior``, per-position rates, ``PRIOR_STRENGTH`` pseudo-round), the engine's pooled
evidence of this proposer in context c across sequences (:class:`PooledAcceptance`, at most ``POOL_STRENGTH``
pseudo-rounds), and this sequence's own rounds. Rule (Thompson sampling): every round draw theta_j ~ Beta(alpha_j,
beta_j) and serve

    k* = argmax_{0 <= k <= k_max}  (E[P](k | theta) + B - 1) / c(k),     E[P](k | theta) = 1 + sum_{j<=k} prod_{i<=j} theta_i

with c(k) the full cost of the engine step the round joins, as the engine measures it (one target forward
holding this round's k + 1 tokens and the other sequences' tokens, k drafts, overhead; c(0) with a plain
step), and B the sequences in the step: the rate is the step's committed tokens per second, the other B - 1
sequences counted at one token each (the least they commit). Every sequence in the step waits for its
forward, so drafts that widen it are charged for the time they cost the others (engine-seconds per output
token); at B = 1 it is the round's own E[P](k) / c(k). Two or more such sequences over n-gram drafts in
one step are planned together instead (:func:`plan_step`): the same rate for the whole step, over every
allocation of drafts, from each sequence's drawn gains prod_{i<=j} theta_i; one at a time, none of them pays for a
step wide enough to reach the GEMM's efficient regime. The round's evidence is discounted by ``DISCOUNT`` per round (discounted Thompson
sampling, Raj & Kalyani 2017: acceptance drifts within a request as copied spans come and go): the posterior
is Beta(prior + discounted hits, prior + discounted misses), so without recent evidence a position returns
to the gateway's estimate for this slice, which is the best one left. Why it is enough: Thompson sampling
plays k with the posterior probability that k has the best rate, so a k the data say loses is played with
a probability that shrinks as its evidence grows (O(log T) regret per losing arm for stationary a_j,
Agrawal & Goyal 2012); the discount bounds the evidence (~1/(1 - DISCOUNT) rounds), so that probability
never reaches zero, which is the re-probe: at k* = 0 nothing is observed, the posterior widens, and a draw
occasionally says k >= 1 pays. No probe schedule, no special case for cold, stale or plain. Sampling rather
than choosing on the posterior mean is what keeps it near the best fixed k when acceptance is always high or
changes within a request (scripted cases in tests/engine/test_adaptive.py; measured on real prompts in
docs/engine.md, "Per-round draft length (`adaptive: true`)").

``sglang`` and ``vllm``: SGLang's and vLLM's own controllers, reproduced to be measured against
(backends/engine/baselines.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from backends.engine.baselines import SglangAdaptive, VllmDynamic
from speculation import MAX_DRAFT_TOKENS

PRIOR_STRENGTH = 1.0  # pseudo-rounds of the prior
DISCOUNT = 0.95  # per round: the posterior remembers ~20 rounds
POOL_DISCOUNT = 0.999  # per round of a context: the engine-wide estimate remembers ~1000 rounds
# at most this many pseudo-rounds of the engine-wide estimate in a sequence's posterior: the engine's evidence
# in the round's context predicts a round better than the sequence's own ~20 discounted rounds do (replayed,
# 80 workload requests, mixed, 20 seeds, two samples of the workloads: TPOT 0.5-1.0% lower at every load than
# with 8; docs/runs/2026-12-03-issue26-auto/README.md, "Counterfactual plain evidence")
POOL_STRENGTH = 128.0
MAX_POSITIONS = MAX_DRAFT_TOKENS  # a controller tracks acceptance at every draft position a round can have
DEFAULT_PRIOR = 0.5  # a_j when the gateway sends no prior: Beta(0.5, 0.5)
GAIN_FLOOR = 1e-3  # a draft adding fewer expected tokens than this is never planned (plan_step)


def expected_tokens(rates, k: int) -> float:
    """E[P](k) = 1 + sum_{j<=k} prod_{i<=j} a_i: tokens a round of k drafts commits."""
    total, survive = 1.0, 1.0
    for j in range(k):
        survive *= rates[j]
        total += survive
    return total


def suffix_min(costs: Sequence[float]) -> list[float]:
    """floor[k] = min(costs[k:]): what best_k bounds a longer k's cost by (valid for any k_max < len(costs))."""
    floor = list(costs)
    for k in range(len(floor) - 2, -1, -1):
        if floor[k + 1] < floor[k]:
            floor[k] = floor[k + 1]
    return floor


def best_k(rates, k_max: int, costs: Sequence[float], others: float = 0.0,
           floor: Sequence[float] | None = None) -> int:
    """argmax_k (E[P](k) + others) / costs[k] over 0..k_max (``others``: tokens the rest of the step commits,
    whatever this k); ties go to the smaller k (plain at exact break-even).

    ``rates`` may be lazy (an iterator of Thompson draws): it is read only while a longer k can still win.
    After position k, any k' > k commits at most E[P](k) + others + prod_{i<=k} a_i * (k_max - k) tokens in
    at least the cheapest costs[k'], so once that bound is no better than the best rate the rest is never
    drawn, and the argmax is the one all k_max draws would give (the draws it reads are the same ones).
    ``floor``: :func:`suffix_min` of ``costs`` (computed here when not given)."""
    if floor is None:
        floor = suffix_min(costs[:k_max + 1])
    best, best_rate = 0, (1.0 + others) / costs[0]
    total, survive = 1.0 + others, 1.0
    k = 0
    rates = iter(rates)
    while k < k_max and total + survive * (k_max - k) > best_rate * floor[k + 1]:
        k += 1
        survive *= next(rates)
        total += survive
        rate = total / costs[k]
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def plan_step(gains: Sequence[Sequence[float]], committed: float, step_s: Callable[[int], float]) -> list[int]:
    """Drafts for each jointly planned sequence of one engine step: the allocation maximising the step's
    committed tokens per second, (committed + sum of the drafts' gains) / step_s(W), over W drafts in all.

    ``gains[i]``: sequence i's marginal tokens by draft position (non-increasing: products of probabilities);
    ``committed``: the tokens the step commits with no planned draft (one per sequence at least);
    ``step_s(W)``: seconds of the step with W planned drafts. For every W the best allocation takes the W
    largest gains (each sequence's taken gains are then a prefix of its own), so one pass over W finds the
    optimum; ties go to the smaller W. Per-sequence choices cannot find it where the step's cost falls per row
    as it widens (MKL's GEMM from ~16 rows on: a step of 4 sequences x 5 tokens cost less than 4 x 3 on an
    AVX-512 Xeon), because no sequence widening the step alone pays for the wider regime."""
    ranked = sorted(((-g, j, i) for i, seq in enumerate(gains) for j, g in enumerate(seq)))
    best_w, best_rate, total = 0, committed / step_s(0), committed
    for w, (neg, _, _) in enumerate(ranked, start=1):
        total -= neg
        rate = total / step_s(w)
        if rate > best_rate:
            best_w, best_rate = w, rate
    drafts = [0] * len(gains)
    for _, _, i in ranked[:best_w]:
        drafts[i] += 1
    return drafts


def match_context(match: int) -> int:
    """The context a round's acceptance is learned under: the n-gram match length that found the draft, in
    buckets 1, 2, 3, 4 (4-7), 8 (8+); 0 for proposers that report none (draft model, suffix)."""
    return 0 if match <= 0 else 8 if match >= 8 else 4 if match >= 4 else match


class Evidence:
    """Discounted per-position acceptance counts of one context. Stored scaled by ``weight`` (a count's true
    value is stored / weight): a discount divides ``weight`` instead of multiplying every position, so a
    round costs the positions it reached, not all of them."""

    __slots__ = ("hits", "misses", "weight")

    def __init__(self, positions: int) -> None:
        self.hits = [0.0] * positions
        self.misses = [0.0] * positions
        self.weight = 1.0

    def discount(self, factor: float) -> None:
        self.weight /= factor
        if self.weight > 1e100:  # fold the weight in before it overflows (~4,500 rounds at 0.95)
            self.hits = [h / self.weight for h in self.hits]
            self.misses = [m / self.weight for m in self.misses]
            self.weight = 1.0

    def count(self, proposed: int, accepted: int) -> None:
        """Count the positions a round reached: 1..min(proposed, accepted + 1), accepted up to ``accepted``,
        the next one rejected."""
        hits, misses, w = self.hits, self.misses, self.weight
        for j in range(min(proposed, accepted + 1, len(hits))):
            if j < accepted:
                hits[j] += w
            else:
                misses[j] += w

    def values(self) -> tuple[list[float], list[float]]:
        """(accepted, rejected) per position, discounted."""
        inv = 1.0 / self.weight
        return [h * inv for h in self.hits], [m * inv for m in self.misses]


class PooledAcceptance:
    """Engine-wide acceptance of one proposer per context, across sequences (discounted by ``POOL_DISCOUNT``
    per round of that context): what a new sequence's posterior starts from, at most ``POOL_STRENGTH``
    pseudo-rounds strong, so a request's own rounds overrule it within a few rounds."""

    __slots__ = ("evidence",)

    def __init__(self) -> None:
        self.evidence: dict[int, Evidence] = {}

    def observe(self, context: int, proposed: int, accepted: int) -> None:
        evidence = self.evidence.get(context)
        if evidence is None:
            evidence = self.evidence[context] = Evidence(MAX_POSITIONS)
        evidence.discount(POOL_DISCOUNT)
        evidence.count(proposed, accepted)

    def counts(self, context: int, k: int) -> tuple[list[float], list[float]]:
        """Pseudo-counts per position (first ``k``), each position's total scaled to <= POOL_STRENGTH."""
        evidence = self.evidence.get(context)
        if evidence is None:
            return [0.0] * k, [0.0] * k
        hits, misses = evidence.values()
        scale = [min(1.0, POOL_STRENGTH / (h + m)) if h + m else 0.0 for h, m in zip(hits[:k], misses[:k])]
        return [h * f for h, f in zip(hits, scale)], [m * f for m, f in zip(misses, scale)]

    def end_step(self) -> None:
        """Engine-wide state is stepped with the shared controllers; nothing to do per step."""


@dataclass(slots=True)
class BetaDraftLength:
    """specgate's per-sequence controller (module docstring). ``round_costs(k_max)``: seconds of a round of
    k = 0..k_max drafts (a sequence at least k_max + 1 long);
    ``prior``: per-position acceptance rates from the gateway (shorter than k_max: the last one repeats);
    ``pooled``: the engine's per-context acceptance of this proposer across sequences (optional)."""

    k_max: int
    round_costs: Callable[[int], Sequence[float]]
    prior: tuple[float, ...] = ()
    seed: int = 0
    pooled: PooledAcceptance | None = None
    evidence: dict[int, Evidence] = field(default_factory=dict)  # per context: this sequence's rounds
    base_a: list[float] = field(init=False)
    base_b: list[float] = field(init=False)
    rng: random.Random = field(init=False)
    _floor: tuple = field(init=False, default=(None, None))  # (the last cost table, its suffix_min)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        rates = list(self.prior) or [DEFAULT_PRIOR]
        rates = [min(max(p, 0.01), 0.99) for p in rates + [rates[-1]] * (self.k_max - len(rates))][:self.k_max]
        self.base_a = [PRIOR_STRENGTH * p for p in rates]
        self.base_b = [PRIOR_STRENGTH * (1 - p) for p in rates]

    def posterior(self, context: int = 0) -> tuple[list[float], list[float]]:
        """Beta parameters per position: the gateway's prior, the engine's pooled evidence, this sequence's."""
        k = self.k_max
        pooled_a, pooled_b = self.pooled.counts(context, k) if self.pooled else ([0.0] * k, [0.0] * k)
        own = self.evidence.get(context)
        hits, misses = own.values() if own is not None else ([0.0] * k, [0.0] * k)
        return ([a + p + h for a, p, h in zip(self.base_a, pooled_a, hits)],
                [b + p + m for b, p, m in zip(self.base_b, pooled_b, misses)])

    def means(self, context: int = 0) -> list[float]:
        alpha, beta = self.posterior(context)
        return [a / (a + b) for a, b in zip(alpha, beta)]

    def choose(self, batch: int = 1, context: int = 0, cap: int | None = None) -> int:
        """k for this round; ``cap``: the drafts available (a prefix-drafting proposer drafted first)."""
        k_max = self.k_max if cap is None else min(cap, self.k_max)
        if k_max <= 0:
            return 0
        costs = self.round_costs(k_max)
        table, floor = self._floor
        if costs is not table:  # a caller that keeps its table (the replay walker) has it computed once
            floor = suffix_min(costs)
            self._floor = (costs, floor)
        return best_k(self._draws(context, k_max), k_max, costs, batch - 1, floor)

    def _draws(self, context: int, k_max: int):
        """theta_j ~ Beta(alpha_j, beta_j) for j = 1..k_max in order, each drawn when best_k reads it (the
        posterior of :meth:`posterior`, position by position)."""
        draw = self.rng.betavariate
        base_a, base_b = self.base_a, self.base_b
        own = self.evidence.get(context)
        pool = self.pooled.evidence.get(context) if self.pooled is not None else None
        if own is not None:
            own_h, own_m, own_inv = own.hits, own.misses, 1.0 / own.weight
        if pool is not None:
            pool_h, pool_m, pool_inv = pool.hits, pool.misses, 1.0 / pool.weight
        for j in range(k_max):
            a, b = base_a[j], base_b[j]
            if pool is not None:
                h, m = pool_h[j] * pool_inv, pool_m[j] * pool_inv
                if h + m:
                    f = min(1.0, POOL_STRENGTH / (h + m))
                    a, b = a + h * f, b + m * f
            if own is not None:
                a, b = a + own_h[j] * own_inv, b + own_m[j] * own_inv
            yield draw(a, b)

    def gains(self, context: int = 0, cap: int | None = None) -> list[float]:
        """This round's Thompson draws as marginal tokens: entry j - 1 is prod_{i<=j} theta_i, what draft j adds
        to the round's expected commit (for :func:`plan_step`); drawing stops once it falls below ``GAIN_FLOOR``."""
        k_max = self.k_max if cap is None else min(cap, self.k_max)
        out: list[float] = []
        survive = 1.0
        for theta in self._draws(context, max(0, k_max)):
            survive *= theta
            if survive < GAIN_FLOOR:
                break
            out.append(survive)
        return out

    def draws(self, context: int, k: int) -> list[float]:
        """Thompson draws for positions 1..k of ``context`` (all of them; :meth:`choose` reads them lazily)."""
        return list(self._draws(context, k))

    def observe(self, proposed: int, accepted: int, context: int = 0) -> None:
        """One round: discount this sequence's evidence (every context), count the round in its context."""
        self.observe_round(((context, proposed, accepted),))

    def observe_round(self, drafts: Sequence[tuple[int, int, int]]) -> None:
        """One round that scored several drafts, (context, proposed, accepted) each (the hybrid proposer's two
        sources, source_choice.py): the evidence is discounted once, every draft that proposed is counted."""
        for evidence in self.evidence.values():
            evidence.discount(DISCOUNT)
        for context, proposed, accepted in drafts:
            if proposed <= 0:
                continue
            evidence = self.evidence.get(context)
            if evidence is None:
                evidence = self.evidence[context] = Evidence(self.k_max)
            evidence.count(proposed, accepted)
            if self.pooled is not None:
                self.pooled.observe(context, proposed, accepted)

    def end_step(self) -> None:
        pass


def controller_for(spec, round_costs: Callable[[int], Sequence[float]], seed: int, shared: dict):
    """The controller of a sequence speculating with ``spec`` (a SpeculationParams with adaptive set):
    its own for ``beta`` (starting from the engine's pooled acceptance of the proposer, which ``shared`` holds);
    for ``sglang`` the one ``shared`` holds for (proposer, draft_tokens), made on first
    use (an engine keeps one ``shared`` dict); ``vllm``'s is stateless."""
    if spec.strategy == "beta":
        pooled = shared.setdefault(("pooled", spec.proposer), PooledAcceptance())
        return BetaDraftLength(k_max=spec.draft_tokens, round_costs=round_costs, prior=spec.prior, seed=seed,
                               pooled=pooled)
    if spec.strategy == "vllm":
        return VllmDynamic(k_max=spec.draft_tokens, table=spec.k_by_batch)
    key = ("sglang", spec.proposer, spec.draft_tokens)
    if key not in shared:
        shared[key] = SglangAdaptive(k_max=spec.draft_tokens)
    return shared[key]
