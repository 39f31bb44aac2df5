"""``auto``: Thompson sampling over options, per context.

In short. Model: each option's log(engine-seconds per output token) in a context (slice, load bucket,
prompt_repeat band) is Normal with a hierarchical prior (the slice's other buckets and bands) and decayed
evidence. Rule: draw from every option's posterior and serve the smallest draw (plain must be beaten by
``min_gain``); an option never tried in the slice is served once first. The rest of this docstring is the
detail of each part.

**Options** of an auto rule: plain decoding, and for each of its pools that may speculate, the pool at each
draft length of its grid (:func:`k_grid`: a fixed k; a range at its ends and the powers of two between; an
adaptive pool at its cap, the worker choosing k per round below it). **Context**: the request's slice, its
load bucket (the pool's running + waiting from ``/v1/loads`` or the gateway's in-flight count, whichever is
higher: :func:`policies.snapshot.load_concurrency`) and its ``prompt_repeat`` band (``learning.repeat_bands``).

**Model.** y = log(seconds per output token) of one request served by option o in context x is
Normal(mu[o, x], s2[o]); s2[o], the spread between requests, is the option's own, pooled over its contexts (a
prior of 0.3 worth ``NU0`` requests): plain decoding's TPOT barely depends on the prompt, a speculative
option's swings with its acceptance (bimodal within a slice), and a spread pooled over both made plain look as
uncertain as speculation and re-measured it for nothing. mu[o, x] has a hierarchical Normal prior: the
option's estimate from the slice's *other* load buckets, widened by ``TAU_LOAD``^2, then updated with this
bucket's other repeat bands, widened by ``TAU_BAND``^2, then updated with this cell's own requests. Each
level's data excludes the level below it, so no request is counted twice. An option never measured in the
slice starts at the slice's plain TPOT (else the slice's mean over all options) with variance ``V0``. Every
sum is decayed (half-life ``learning.half_life_s``), so old evidence weighs less than new; a posterior *mean*
uses the sums as of the latest outcome behind them and does not move while nothing is observed, while its
*variance* uses them decayed to now and grows back toward the prior's.

**Counterfactual evidence for plain.** A speculative request's worker may report what plain decoding would
have cost it (``specgate_plain_ratio``, the embedded engine's step-cost model: each round's measured step
scaled to the step without its drafts; ``Outcome.plain_tpot_s``); that counts as one observation of plain in
the request's context. Plain is then measured wherever speculation serves, so it need not be served to be
known, and Thompson sampling explores it only where its draw can win. The pair also measures the option's *gap*
g[o, x] = log(TPOT / plain's estimate) request by request, with the same hierarchical prior (anchored at 0):
an option with such evidence in the slice is drawn as plain's draw plus its gap's, so the prompt-to-prompt
spread of TPOT, which moves both alike, and plain's own uncertainty drop out of the comparison. A real SGLang
server sends no such estimate; plain is then learned from the requests it serves and options compare by
their own posteriors. Plain is never explored against a paired option the posterior means prefer: every
request that option serves measures plain too, so a plain request would teach nothing and only cost its
slowdown (replayed on 200 unseen prompts, 20 seeds, with the cold order below: 1.2-1.4% lower TPOT at c1 and
p0.5, 0.1-0.4% at c4 and c16, docs/runs/2026-12-06-issue55-limits/README.md). Where the means prefer plain, the draws decide as before: the
option must be served to be measured again. For the same reason a new slice is tried with such an option
(paired in another slice) before plain, whose first request it then measures.

**Full information for model-free options.** A greedy answer's output ids are the same under every option, and
a fixed-k n-gram or suffix option's rounds follow from them, so a served greedy request also carries one
observation of each such option of its rule (:func:`counterfactual_options`; ``Outcome.counterfactual``,
priced by replay/evidence.py relative to plain on the same answer): those options are learned on every request,
never served cold, and explored only while their posterior could still win.

**Decision.** Draw mu[o, x] from every option's posterior and serve the smallest draw; a speculative option
must beat plain's draw by log(``learning.min_gain``). Without a random source (explanations) the posterior
means decide. An option never served in the slice is served first (one request each, in the rule's order,
plain first; not while one is in flight on its pool), as bandits pull every arm once: a hierarchical prior
with no data under it is only the anchor's guess. Every request in flight exploring an option counts as one
more observation at its current mean (the "believer" rule of batched Thompson sampling), so a burst of
arrivals does not all try the same barely measured option on the same evidence.

**SLO.** A request with a TPOT SLO (``learning.slo_objective``: by default only one it states itself, the
``x-slo-tpot-ms`` header) is served by the cheapest option among those whose chance of meeting it is within
``SLO_SLACK`` of the best chance: an option's chance is P(y <= SLO) for y = exp(mu + its request spread s2[o]), mu
drawn as above. A loose SLO every option meets changes nothing; a tight one moves the request to the option
likeliest to meet it, e.g. plain decoding, whose TPOT barely spreads, over a speculative option that is faster
on average but slow on the prompts its drafts miss. y is engine-seconds per token, at least the request's own
TPOT (they are equal when it is served alone), so under load the chance is a lower bound.

Why this suffices (sketch): Thompson sampling serves each option with the posterior probability that it is
the best; with Gaussian rewards its expected regret over T requests is O(sqrt(K T log K)) for K options
(Agrawal & Goyal, 2013), so a worse option's share falls as its evidence grows. The special cases of the
learner this replaces follow from the rule: a *cold* option has a wide posterior and is drawn often until
measured; a *stale* one (evidence decayed) widens again and is re-drawn, in proportion to how plausibly it
could win, with its mean untouched (it does not drift to a pessimistic prior); a *new load* bucket borrows the
other buckets' estimates widened by ``TAU_LOAD``, so options near the best are re-measured there; the
per-context means make costs per slice and per load by construction. The objective is engine-seconds per
output token: the request's TPOT plus what its drafts cost the sequences beside it, per token
(``Outcome.neighbour_tpot_s``, which the embedded worker measures step by step: each other sequence of a step
waited for the drafting and the wider forward). Against plain's c0 a token, an option of accept length E and
Delta extra seconds a step with B sequences wins iff B * Delta < (E - 1) * c0: the embedded engine's per-round
controller's rule (backends/engine/adaptive.py), so the two never disagree on a step. A real SGLang server
reports no such cost; its pools (one configuration per server) batch only their own requests, whose TPOT
already carries it.

Assumptions: requests in one context are exchangeable; an option's log TPOT spreads alike in all its contexts.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Mapping

import msgspec

from policies.schema import Policy

NU0, S0 = 4.0, 0.3  # the spread's prior: 0.3 in log TPOT (1.35x), worth 4 requests
# how far an option's log TPOT in one load bucket may sit from the slice's other buckets (prior sd), and in one
# prompt_repeat band from the bucket's other bands: tight, so a cell's few requests refine what the slice's
# others measured rather than re-measure it (replayed, 80 workload requests, two samples: 0.5 / 0.25 explored
# plain again in every new Poisson-load cell, 4-5% slower at p0.25;
# docs/runs/2026-12-03-issue26-auto/README.md, "Counterfactual plain evidence, tighter priors")
TAU_LOAD = 0.1
TAU_BAND = 0.1
V0 = 1.0  # variance of the first guess for an option never measured in the slice (a factor e either way)
DEFAULT_LOG_TPOT = math.log(0.05)  # nothing measured anywhere: 50 ms a token; only ranks equal options
PLAIN = "none"  # the option label of plain decoding
# options whose chance of meeting a request's TPOT SLO is within this of the best one's are equal for it; the
# cheapest of them serves (so estimation noise in the chances does not override the cost ranking)
SLO_SLACK = 0.05


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """One option auto weighed (for explain and the admin endpoint). ``pool`` "" is plain decoding.
    ``samples``: the decayed requests of this option in the request's own context; ``p_best``: the share of
    posterior draws in which it wins (256 seeded draws)."""

    pool: str
    draft_tokens: int
    eligible: bool = True
    note: str = ""
    predicted_tpot_ms: float | None = None
    sd: float | None = None  # posterior sd of log TPOT
    speedup: float | None = None  # posterior-mean speedup over plain decoding in this context
    samples: float = 0.0
    p_best: float | None = None
    expected_accept_length: float | None = None
    slo_chance: float | None = None  # at the posterior mean: P(TPOT <= the request's TPOT SLO), when one steers


class CounterfactualOption(msgspec.Struct, frozen=True):
    """An option of an auto rule whose cost on a served greedy request follows from its ids (a fixed-k
    model-free pool: replay/evidence.py), keyed as the learner keys it (:func:`option_label`)."""

    label: str
    proposer: str
    k: int


def counterfactual_options(policy: Policy, pools: tuple[str, ...], versions: Mapping[str, str],
                           served: tuple[str, int]) -> tuple[CounterfactualOption, ...]:
    """The options of ``pools`` every greedy request can teach auto about besides the ``served`` (pool, k):
    each fixed-k n-gram or suffix pool at every k of its grid. An adaptive pool's rounds depend on its
    controller's draws and a draft model's on a model, so those learn only from the requests they serve."""
    if not policy.learning.counterfactual:
        return ()
    out = []
    for pool in pools:
        spec = policy.pools[pool]
        if spec.proposer not in ("ngram", "suffix") or spec.adaptive:
            continue
        out += [CounterfactualOption(option_label(pool, k, versions.get(pool, "")), spec.proposer, k)
                for k in k_grid(policy, pool) if (pool, k) != served]
    return tuple(out)


def option_label(pool: str, k: int, pair_version: str = "") -> str:
    """How an option is keyed in the learner: ``none`` (plain decoding), else ``pool@k#pair_version`` (a new
    pair version is a new option: its evidence starts empty)."""
    return PLAIN if not pool or k <= 0 else f"{pool}@{k}#{pair_version}"


def k_grid(policy: Policy, pool: str) -> list[int]:
    """The draft lengths auto offers for ``pool``: its fixed k; an adaptive pool's cap; a range's ends and the
    powers of two between (1..8 -> 1, 2, 4, 8: each arm must be measured, so fewer arms learn faster)."""
    spec = policy.pools[pool]
    lo, hi = spec.k_range
    if spec.adaptive or lo == hi:
        return [hi]
    return sorted({lo, hi} | {1 << i for i in range(hi.bit_length()) if lo <= 1 << i <= hi})


def repeat_band(learning, prompt_repeat: float | None) -> int:
    """The ``prompt_repeat`` band of a request (``learning.repeat_bands`` edges; not computed counts as 0)."""
    return bisect.bisect_right(learning.repeat_bands, prompt_repeat or 0.0)


class Posterior(msgspec.Struct, frozen=True):
    mean: float
    var: float
    own: float  # decayed requests in the cell itself


def _update(mean: float, var: float, w: float, sy: float, s2: float, f: float = 1.0) -> tuple[float, float]:
    """Normal prior (mean, var) and w observations summing to sy with noise variance s2, where w and sy are
    decayed to now and ``f`` is the decay since the latest of them: the mean uses them as of that outcome
    (w / f), the variance as of now (w), so time without evidence widens a posterior and leaves its mean."""
    if w <= 1e-12:
        return mean, var
    p_now, p_then = 1.0 / var + w / s2, 1.0 / var + w / (f * s2)
    return (mean / var + sy / (f * s2)) / p_then, 1.0 / p_now


def posterior(snap, slice_: str, bucket: int, band: int, label: str, in_flight: float = 0.0,
              table: str = "arms") -> Posterior:
    """The posterior of mu[label, (slice_, bucket, band)] (module docstring), ``in_flight`` believer
    observations included; with ``table`` "gaps", of the option's log speedup g[label, x] instead (anchored at
    0, no speedup)."""
    s2 = snap.arm_spread(label, S0 * S0, NU0, table)
    (w2, y2, f2), (w1, y1, f1), (w0, y0, f0) = snap.arm_levels(slice_, bucket, band, label, table)
    mean, var = (snap.arm_anchor(slice_), V0) if table == "arms" else (0.0, V0)
    # the slice's other load buckets, then this bucket's other repeat bands (decayed as of the level's latest)
    mean, var = _update(mean, var, w2 - w1, y2 - y1, s2, f2)
    var += TAU_LOAD * TAU_LOAD
    mean, var = _update(mean, var, w1 - w0, y1 - y0, s2, f1)
    var += TAU_BAND * TAU_BAND
    mean, var = _update(mean, var, w0, y0, s2, f0)
    if in_flight > 0:
        mean, var = _update(mean, var, in_flight, in_flight * mean, s2)
    return Posterior(mean, var, w0)


class Choice(msgspec.Struct, frozen=True):
    pool: str  # "" for plain decoding
    k: int
    exploration: str | None  # cold | thompson | None (the posterior mean's best)
    speedup: float | None  # posterior-mean speedup over plain of the chosen option
    candidates: list[Candidate]
    plain_tpot_s: float | None
    posterior_tpot_ms: dict[str, float]  # every option's posterior-mean TPOT by its note (``option_note``)
    slo_chance: float | None = None  # the chosen option's, at its posterior mean, when a TPOT SLO steered


def slo_chance(log_tpot: float, sd: float, log_slo: float) -> float:
    """P(log y <= log_slo) for log y ~ Normal(log_tpot, sd^2): the chance a request meets its TPOT SLO."""
    return 0.5 * math.erfc((log_tpot - log_slo) / (sd * math.sqrt(2.0)))


def choose(policy: Policy, snap, slice_: str, prompt_repeat: float | None, pools: tuple[str, ...],
           versions: Mapping[str, str], rng: random.Random | None, in_flight: Mapping[str, int],
           explain: bool = False, tpot_slo_s: float | None = None) -> Choice:
    """Thompson sampling over plain and every (pool, k) of ``pools`` (module docstring); ``versions``: each
    pool's pair version. ``in_flight``: explorations in flight per ``slice|pool`` (``slice|none`` for plain).
    ``tpot_slo_s``: the TPOT SLO that steers the choice (module docstring, "SLO"); None: cost alone."""
    bucket, band = snap.bucket(), repeat_band(policy.learning, prompt_repeat)
    options = [("", 0)] + [(p, k) for p in pools for k in k_grid(policy, p)]
    labels = [option_label(p, k, versions.get(p, "")) for p, k in options]
    flights = [in_flight.get(f"{slice_}|{p or PLAIN}", 0) for p, _ in options]
    posts = [posterior(snap, slice_, bucket, band, label, n) for label, n in zip(labels, flights)]
    # an option with paired evidence (the worker's plain estimate beside its own TPOT) is weighed by its gap
    gaps = [None] + [posterior(snap, slice_, bucket, band, label, n, table="gaps")
                     if snap.arm_ever(slice_, label, table="gaps") >= 1.0 else None
                     for label, n in zip(labels[1:], flights[1:])]
    margin = math.log(policy.learning.min_gain)

    def scores(draw) -> list[float]:
        """Each option's log TPOT drawn by ``draw(posterior)``: plain's, less the margin it wins by; a paired
        option's as plain's plus its gap; another's its own."""
        plain_value = draw(posts[0])
        return [plain_value - margin] + [plain_value + draw(g) if g is not None else draw(post)
                                         for post, g in zip(posts[1:], gaps[1:])]

    log_slo = math.log(tpot_slo_s) if tpot_slo_s else None
    sds = [math.sqrt(snap.arm_spread(label, S0 * S0, NU0)) for label in labels] if log_slo is not None else []

    def chances(values: list[float]) -> list[float]:
        """Each option's chance of meeting the SLO given its drawn log TPOT (plain's without the margin)."""
        return [slo_chance(v + (margin if i == 0 else 0.0), sd, log_slo) for i, (v, sd) in enumerate(zip(values, sds))]

    def best(values: list[float]) -> int:
        if log_slo is None:
            return min(range(len(values)), key=values.__getitem__)
        p = chances(values)
        top = max(p)
        return min((i for i in range(len(values)) if p[i] >= top - SLO_SLACK), key=values.__getitem__)

    means = scores(lambda post: post.mean)
    by_mean = best(means)
    untried = [] if rng is None else [i for i, (p, _) in enumerate(options) if snap.arm_ever(slice_, labels[i]) < 1.0
                                      and not in_flight.get(f"{slice_}|{p or PLAIN}", 0)]
    if untried and untried[0] == 0 and any(snap.paired(labels[i]) for i in untried[1:]):
        untried = untried[1:] + [0]  # a paired option's first request measures plain too
    if rng is None:
        pick = by_mean
    elif untried:  # every option is served once per slice before the draws decide
        pick = untried[0]
    else:
        pick = best(scores(lambda post: rng.gauss(post.mean, math.sqrt(post.var))))
        if pick == 0 and gaps[by_mean] is not None:  # plain is measured by every request of a paired option
            pick = by_mean
    exploration = None
    if pick != by_mean or pick in untried:
        exploration = "cold" if snap.arm_ever(slice_, labels[pick], (bucket, band)) < 1.0 else "thompson"
    plain_mean = posts[0].mean
    at_mean = chances(means) if log_slo is not None else None
    candidates: list[Candidate] = []
    if explain:
        draws = random.Random(0)
        wins = [0] * len(options)
        for _ in range(256):
            wins[best(scores(lambda post: draws.gauss(post.mean, math.sqrt(post.var))))] += 1
        for i, ((p, k), post, gap) in enumerate(zip(options, posts, gaps)):
            mean = means[i] + (margin if i == 0 else 0.0)
            candidates.append(Candidate(
                pool=p, draft_tokens=k, predicted_tpot_ms=math.exp(mean) * 1e3,
                sd=math.sqrt((gap or post).var), speedup=math.exp(plain_mean - mean), samples=post.own,
                p_best=wins[i] / 256, slo_chance=at_mean[i] if at_mean is not None else None,
                note=option_note(p, k) + (" (the worker picks k per round up to it)"
                                          if p and policy.pools[p].adaptive else "")))
    # plain's mean less the margin is its score, not its estimate
    posterior_ms = {option_note(*option): round(math.exp(mean + (margin if i == 0 else 0.0)) * 1e3, 3)
                    for i, (option, mean) in enumerate(zip(options, means))}
    p, k = options[pick]
    return Choice(pool=p, k=k, exploration=exploration,
                  speedup=None if pick == 0 else math.exp(plain_mean - means[pick]),
                  candidates=candidates, plain_tpot_s=math.exp(plain_mean), posterior_tpot_ms=posterior_ms,
                  slo_chance=at_mean[pick] if at_mean is not None else None)


def option_note(pool: str, k: int) -> str:
    """An option as people read it: ``plain decoding`` or ``POOL k=K``."""
    return f"{pool} k={k}" if pool else "plain decoding"
