"""``decide(policy, features, snapshot) -> Decision``: a pure function (same inputs and seed, same result).

Order: slice (first matching slice) -> rules (first match decides) -> action (bypass | a pool with a fixed
or auto draft length | auto). Built-in safety, whatever the rules say: a speculative pool that is unhealthy
or whose pair is not verified (False, or not yet probed) is never chosen for speculation; the request falls
back to a healthy plain pool, else to the same per-request workers with speculation switched off.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from typing import Any, Literal, NamedTuple, get_args

import msgspec

from policies.auto import Candidate, CounterfactualOption, choose, counterfactual_options
from policies.compiled import Compiled, Ctx, compiled
from policies.features import RequestFeatures
from policies.schema import Policy, PoolAction
from policies.slicing import classify
from policies.snapshot import Snapshot
from speculation import PLAIN_OVERRIDE, SpeculationOverride


Exploration = Literal["cold", "thompson"]
EXPLORATIONS: tuple[str, ...] = get_args(Exploration)


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """What to do with one request. ``draft_tokens`` 0 and ``bypass`` True mean no speculation.
    ``speculation_override``: send as ``custom_params.speculation`` (per_request pools only).
    ``exploration``: whether ``auto``'s posterior draw chose an option other than the best posterior mean
    (None: it did not): *cold* (the option was never measured in this context) or *thompson* (it was)."""

    slice: str
    pool: str
    proposer: str
    draft_tokens: int
    bypass: bool
    rule: str
    reason: str
    speculation_override: SpeculationOverride | None = None
    fallback: bool = False
    exploration: Exploration | None = None
    predicted_speedup: float | None = None  # auto's prediction for the option it chose to exploit
    expected_accept_length: float | None = None
    held_by_gate: str | None = None  # the pool the serving gate's ramp held this request back from
    # auto's posterior-mean TPOT (ms) of every option it weighed, by ``policies.auto.option_note``
    posterior_tpot_ms: dict[str, float] | None = None
    # the auto rule's options a greedy answer to this request can teach the learner about without serving them
    # (policies.auto.counterfactual_options; replay/evidence.py prices them)
    counterfactual: tuple[CounterfactualOption, ...] = ()

    @property
    def explored(self) -> bool:
        return self.exploration is not None


class RuleTrace(msgspec.Struct, frozen=True, kw_only=True):
    rule: str
    matched: bool
    conditions: list[str]
    failed: str | None = None


class Explanation(msgspec.Struct, frozen=True, kw_only=True):
    """The structured trace behind a decision (``specgate policy explain``, the admin endpoint)."""

    features: RequestFeatures
    slice: str
    slice_index: int
    rules: list[RuleTrace]
    candidates: list[Candidate]
    plain_tpot_ms: float | None
    decision: Decision


class _Trace:
    __slots__ = ("rules", "candidates", "t_plain")

    def __init__(self) -> None:
        self.rules: list[RuleTrace] = []
        self.candidates: list[Candidate] = []
        self.t_plain: float | None = None


def decide(policy: Policy, features: RequestFeatures, snapshot: Snapshot, *,
           rng: random.Random | None = None, exploring: Collection[str] = frozenset()) -> Decision:
    """Decide for one request; ``rng`` drives auto's posterior draws (None: the posterior means decide).
    ``exploring``: the :func:`exploration_key` of every exploration still in flight (a mapping to how many, or
    a collection of keys, one each); auto counts each as an observation at its option's current mean."""
    return _decide(policy, features, snapshot, rng, None, exploring)


def explain(policy: Policy, features: RequestFeatures, snapshot: Snapshot, *,
            rng: random.Random | None = None, exploring: Collection[str] = frozenset()) -> Explanation:
    """:func:`decide` plus the slice, every rule tried and every auto candidate."""
    trace = _Trace()
    decision = _decide(policy, features, snapshot, rng, trace, exploring)
    name, index = classify(policy, features)
    return Explanation(features=features, slice=name, slice_index=index, rules=trace.rules,
                       candidates=trace.candidates, decision=decision,
                       plain_tpot_ms=trace.t_plain * 1e3 if trace.t_plain is not None else None)


def exploration_key(decision: Decision) -> str | None:
    """What ``decision`` explores, as ``slice|pool`` (``slice|none`` for plain decoding), or None when it
    is not an exploration. The gateway counts these in flight and passes them to :func:`decide`. Per pool,
    not per k: with per-k keys, open-loop arrivals at p0.5 explored the self-draft pool at k=4, 3, 2 and 1 at
    once, each ~800 ms per token and stretching every request in flight (the serve-rep2 run,
    docs/runs/2026-11-29-serving-loads16/README.md)."""
    if not decision.explored:
        return None
    return _option_key(decision.slice, "none" if decision.bypass else decision.pool)


def _option_key(slice_: str, pool: str) -> str:
    return f"{slice_}|{pool}"


def _safe(snap: Snapshot, pool: str) -> str | None:
    """Why ``pool`` may not speculate now, or None when it may."""
    state = snap.pool(pool)
    if not state.healthy:
        return f"pool '{pool}' is unhealthy"
    if state.pair_verified is not True:
        return f"pool '{pool}' pair is {'not yet verified' if state.pair_verified is None else 'mismatched'}"
    if state.gate in ("pending", "failed"):  # degraded pools are the policy's call (``pair_gate``)
        return f"pool '{pool}' pair gate is {state.gate}" + (" (equivalence not yet passed)"
                                                             if state.gate == "pending" else "")
    return None


def _plain(policy: Policy, comp: Compiled, snap: Snapshot, slice_: str, rule: str, reason: str,
           near: tuple[str, ...], fallback: bool = False, exploration: Exploration | None = None,
           posterior: dict[str, float] | None = None) -> Decision:
    """Serve without speculation: a healthy plain pool, else the same per-request workers, else any."""
    options = [p for p in comp.plain_pools if snap.pool(p).healthy]
    options += [p for p in near + tuple(comp.speculative)
                if policy.pools[p].speculation == "per_request" and snap.pool(p).healthy]
    options += comp.plain_pools + [p for p in comp.speculative if policy.pools[p].speculation == "per_request"]
    pool = options[0]
    return Decision(slice=slice_, pool=pool, proposer="none", draft_tokens=0, bypass=True, rule=rule,
                    reason=reason, fallback=fallback, exploration=exploration, posterior_tpot_ms=posterior,
                    speculation_override=plain_override(policy, pool))


def speculation_override(policy: Policy, pool: str, k: int) -> SpeculationOverride | None:
    """``custom_params.speculation`` for a request on ``pool`` at draft length ``k`` (None: a server pool,
    whose workers speculate as launched)."""
    spec = policy.pools[pool]
    if spec.speculation != "per_request":
        return None
    if not spec.adaptive:
        return SpeculationOverride(proposer=spec.proposer, draft_tokens=k, adaptive=False)
    table = [pair for pair in spec.batch_table] if spec.strategy == "vllm" else None
    return SpeculationOverride(proposer=spec.proposer, draft_tokens=k, adaptive=True, strategy=spec.strategy,
                               k_by_batch=table)


def plain_override(policy: Policy, pool: str) -> SpeculationOverride | None:
    """What a plain attempt on ``pool`` sends: per-request workers are told not to speculate; a server pool
    serving plain needs nothing (the only way ``pool`` serves without speculation, the one place it is said)."""
    return PLAIN_OVERRIDE if policy.pools[pool].speculation == "per_request" else None


class Attempt(NamedTuple):
    """One try of a request: the pool, what it runs, and the ``custom_params.speculation`` to send."""

    pool: str
    proposer: str
    draft_tokens: int
    override: SpeculationOverride | None


def plan_attempts(policy: Policy, d: Decision) -> list[Attempt]:
    """The decision's own attempt, then the plain fallbacks a worker failure moves on to, in order: every plain
    pool, then every per-request pool with speculation off (``gateway/dispatch.py``, ``gateway/resume.py``)."""
    out = [Attempt(d.pool, d.proposer, d.draft_tokens, d.speculation_override)]
    for name in compiled(policy).fallback_pools:
        if name != d.pool or d.proposer != "none":
            out.append(Attempt(name, "none", 0, plain_override(policy, name)))
    return out


def _speculate(policy: Policy, slice_: str, pool: str, k: int, rule: str, reason: str,
               exploration: Exploration | None = None, speedup: float | None = None,
               accept_length: float | None = None, posterior: dict[str, float] | None = None) -> Decision:
    spec = policy.pools[pool]
    override = speculation_override(policy, pool, k)
    return Decision(slice=slice_, pool=pool, proposer=spec.proposer, draft_tokens=k, bypass=False, rule=rule,
                    reason=reason, speculation_override=override, exploration=exploration,
                    predicted_speedup=speedup, expected_accept_length=accept_length, posterior_tpot_ms=posterior)


def _decide(policy: Policy, features: RequestFeatures, snap: Snapshot, rng: random.Random | None,
            trace: _Trace | None, exploring: Collection[str]) -> Decision:
    comp = compiled(policy)
    slice_, _ = classify(policy, features)
    ctx = Ctx(features, slice_, snap, comp)
    for crule in comp.rules:
        ctx.subjects = crule.subjects
        if trace is None:
            for fn in crule.fns:
                if not fn(ctx):
                    break
            else:
                return _ramp(policy, comp, snap, _act(policy, comp, snap, features, slice_, crule, rng, trace,
                                                      exploring), crule.subjects, rng)
            continue
        failed = next((label for label, pred in crule.preds if not pred(ctx)), None)
        if trace is not None:
            trace.rules.append(RuleTrace(rule=crule.rule.name, matched=failed is None, failed=failed,
                                         conditions=[label for label, _ in crule.preds]))
        if failed is None:
            return _ramp(policy, comp, snap, _act(policy, comp, snap, features, slice_, crule, rng, trace, exploring),
                         crule.subjects, rng)
    return _plain(policy, comp, snap, slice_, "(none)", "no rule matched; serving without speculation", ())


def _ramp(policy: Policy, comp: Compiled, snap: Snapshot, d: Decision, near: tuple[str, ...],
          rng: random.Random | None) -> Decision:
    """The serving gate: a pool still ramping up in this load region serves only its share of what the policy
    sends it; the rest is served plain on the same slice and load (the ramp's comparison). Without ``rng``
    (explanations) only a closed region (share 0) holds."""
    if d.bypass:
        return d
    share = snap.pool(d.pool).share(d.slice, snap.bucket())
    if share >= 1.0 or (share > 0.0 and (rng is None or rng.random() < share)):
        return d
    where = f"slice {d.slice}, load bucket {snap.bucket()}"
    note = (f"closed in {where} (it missed the serving gate's thresholds there)" if share <= 0.0
            else f"ramping in {where} at share {share:.2f}; this request is its plain comparison")
    held = _plain(policy, comp, snap, d.slice, d.rule, f"{d.reason}; serving gate: pool '{d.pool}' is {note}",
                  near)
    return msgspec.structs.replace(held, held_by_gate=d.pool)


def _act(policy: Policy, comp: Compiled, snap: Snapshot, features: RequestFeatures, slice_: str, crule: Any,
         rng: random.Random | None, trace: _Trace | None, exploring: Collection[str]) -> Decision:
    rule, action = crule.rule.name, crule.rule.then
    why = " and ".join(label for label, _ in crule.preds) or "catch-all"
    if action == "bypass":
        return _plain(policy, comp, snap, slice_, rule, f"rule '{rule}' ({why}) bypasses speculation",
                      crule.subjects)
    if isinstance(action, PoolAction) and isinstance(action.draft_tokens, int):
        unsafe = _safe(snap, action.pool)
        if unsafe:
            return _plain(policy, comp, snap, slice_, rule, f"rule '{rule}' chose pool '{action.pool}' but "
                          f"{unsafe}; safety fallback without speculation", crule.subjects, fallback=True)
        return _speculate(policy, slice_, action.pool, action.draft_tokens, rule,
                          f"rule '{rule}' ({why}) pins pool '{action.pool}' with k={action.draft_tokens}")
    return _auto(policy, comp, snap, features, slice_, rule, crule.subjects, rng, trace, exploring)


def steering_slo_ms(policy: Policy, features: RequestFeatures) -> float | None:
    """The TPOT SLO that steers ``auto`` for this request (``learning.slo_objective``), None for cost alone."""
    mode = policy.learning.slo_objective
    if mode == "none" or (mode == "stated" and not features.slo_tpot_stated):
        return None
    return features.slo_tpot_ms


def _auto(policy: Policy, comp: Compiled, snap: Snapshot, features: RequestFeatures, slice_: str, rule: str,
          pools: tuple[str, ...], rng: random.Random | None, trace: _Trace | None,
          exploring: Collection[str]) -> Decision:
    unsafe = [(p, why) for p in pools if (why := _safe(snap, p))]
    safe = tuple(p for p in pools if not any(p == u for u, _ in unsafe))
    if not safe:
        notes = "; ".join(why for _, why in unsafe) or "no speculative pool"
        return _plain(policy, comp, snap, slice_, rule, f"rule '{rule}' auto: no pool may speculate ({notes})",
                      pools, fallback=bool(unsafe))
    in_flight = exploring if isinstance(exploring, Mapping) else dict.fromkeys(exploring, 1)
    slo_ms = steering_slo_ms(policy, features)
    c = choose(policy, snap, slice_, features.prompt_repeat, safe, comp.pair_versions, rng, in_flight,
               explain=trace is not None, tpot_slo_s=slo_ms / 1e3 if slo_ms else None)
    if trace is not None:
        trace.candidates = [msgspec.structs.replace(x, expected_accept_length=_accept_length(
            policy, comp, snap, features.route, slice_, x.pool)) if x.pool else x for x in c.candidates]
        trace.t_plain = c.plain_tpot_s
    # "auto: exploring WHAT (why)": bench/serve/analyse.py names an exploration by WHAT
    verb = "" if c.exploration is None else "exploring "
    why = {"cold": " (never measured here)", "thompson": " (a posterior draw)", None: ""}[c.exploration]
    if c.slo_chance is not None:
        why += f" (TPOT SLO {slo_ms:g} ms: met with p={c.slo_chance:.2f})"
    evidence = counterfactual_options(policy, safe, comp.pair_versions, (c.pool, c.k))
    if not c.pool:
        d = _plain(policy, comp, snap, slice_, rule, f"rule '{rule}' auto: {verb}plain decoding{why}", pools,
                   exploration=c.exploration, posterior=c.posterior_tpot_ms)
        return msgspec.structs.replace(d, counterfactual=evidence)
    accept = _accept_length(policy, comp, snap, features.route, slice_, c.pool)
    d = _speculate(policy, slice_, c.pool, c.k, rule,
                   f"rule '{rule}' auto: {verb}pool '{c.pool}' k={c.k}{why}, posterior-mean speedup "
                   f"{c.speedup:.2f}x over plain", exploration=c.exploration,
                   speedup=c.speedup if c.exploration is None else None, accept_length=accept,
                   posterior=c.posterior_tpot_ms)
    return msgspec.structs.replace(d, counterfactual=evidence)


def _accept_length(policy: Policy, comp: Compiled, snap: Snapshot, route: str, slice_: str, pool: str
                   ) -> float | None:
    """The pool's measured accept length on this route and slice (for the explanation; auto does not use it)."""
    summary, _ = snap.acceptance(route, slice_, pool, comp.pair_versions[pool], policy.learning.min_rounds)
    return summary.mean_accept_length if summary is not None else None
