"""Policy conditions compiled once into predicate closures, so a decision costs a few microseconds.

A compiled form is cached per Policy object (policies are immutable; the cache entry dies with the policy).
Each predicate comes with a label (``prompt_tokens >= 1500``) for :func:`policies.decide.explain`.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Callable

from policies.schema import Policy, PoolAction, Range, Rule, RuleWhen, SliceWhen

Pred = Callable[["Ctx"], bool]


class Ctx:
    """What predicates read: the features, the slice, the snapshot and the rule's subject pools."""

    __slots__ = ("f", "slice", "snap", "compiled", "subjects")

    def __init__(self, f: Any, slice_: str, snap: Any, compiled: "Compiled") -> None:
        self.f, self.slice, self.snap, self.compiled, self.subjects = f, slice_, snap, compiled, ()


_OPS = {"gt": (operator.gt, ">"), "gte": (operator.ge, ">="), "lt": (operator.lt, "<"),
        "lte": (operator.le, "<="), "eq": (operator.eq, "==")}


def _num(cond: float | Range) -> tuple[Callable[[float | None], bool], str]:
    """A None-safe numeric test; single-bound tests (the common case) get a closure of their own."""
    if not isinstance(cond, Range):
        return (lambda v: v is not None and v == cond), f"== {cond:g}"
    checks = [(_OPS[op][0], float(b), f"{_OPS[op][1]} {b:g}") for op in _OPS
              if (b := getattr(cond, op)) is not None]
    label = " and ".join(text for _, _, text in checks)
    if len(checks) == 1:
        fn, bound, _ = checks[0]
        return (lambda v: v is not None and fn(v, bound)), label
    fns = [(fn, bound) for fn, bound, _ in checks]
    return (lambda v: v is not None and all(fn(v, b) for fn, b in fns)), label


def _one_of(cond: str | list[str]) -> tuple[frozenset[str], str]:
    values = frozenset([cond] if isinstance(cond, str) else cond)
    return values, (f"== {cond}" if isinstance(cond, str) else "in [" + ", ".join(cond) + "]")


def _feature_preds(when: SliceWhen) -> list[tuple[str, Pred]]:
    out: list[tuple[str, Pred]] = []
    for name in ("route", "model"):
        cond = getattr(when, name)
        if cond is not None:
            values, label = _one_of(cond)
            out.append((f"{name} {label}", lambda c, n=name, s=values: getattr(c.f, n) in s))
    if when.response_format is not None:
        values, label = _one_of(when.response_format)
        out.append((f"response_format {label}", lambda c, s=values: (c.f.response_format or "none") in s))
    for name in ("has_tools", "stream"):
        cond = getattr(when, name)
        if cond is not None:
            out.append((f"{name} is {cond}", lambda c, n=name, v=cond: getattr(c.f, n) is v))
    for header, cond in (when.headers or {}).items():
        values, label = _one_of(cond)
        out.append((f"header {header.lower()} {label}",
                    lambda c, h=header.lower(), s=values: c.f.headers.get(h) in s))
    for name in ("prompt_tokens", "max_tokens", "temperature", "code_score", "prompt_repeat", "slo_ttft_ms",
                 "slo_tpot_ms"):
        cond = getattr(when, name)
        if cond is not None:
            test, label = _num(cond)
            out.append((f"{name} {label}", lambda c, n=name, t=test: t(getattr(c.f, n))))
    return out


def _pool_num(label: str, cond: float | Range, read: Callable[[Ctx, str], float | None]) -> tuple[str, Pred]:
    test, text = _num(cond)
    return f"{label} {text}", lambda c: any(test(read(c, p)) for p in c.subjects)


def _rule_preds(when: RuleWhen) -> list[tuple[str, Pred]]:
    out: list[tuple[str, Pred]] = []
    if when.slice is not None:
        values, label = _one_of(when.slice)
        out.append((f"slice {label}", lambda c, s=values: c.slice in s))
    out += _feature_preds(when)
    for name, read in (("budget_tokens", lambda f: f.budget), ("concurrency", None)):
        cond = getattr(when, name)
        if cond is not None:
            test, label = _num(cond)
            getter = (lambda c, r=read: r(c.f)) if read else (lambda c: c.snap.concurrency)
            out.append((f"{name} {label}", lambda c, t=test, g=getter: t(g(c))))
    if when.pool_healthy is not None:
        out.append((f"pool.healthy is {when.pool_healthy}",
                    lambda c, v=when.pool_healthy: any(c.snap.pool(p).healthy is v for p in c.subjects)))
    if when.pair_verified is not None:
        want = when.pair_verified  # false also matches "not yet probed" (None)
        out.append((f"pair_verified is {want}",
                    lambda c: any((c.snap.pool(p).pair_verified is True) is want for p in c.subjects)))
    if when.pair_gate is not None:  # a pool without a gate (no pair, or no gates: section) matches no state
        states, label = _one_of(when.pair_gate)
        out.append((f"pair_gate {label}", lambda c, s=states: any(c.snap.pool(p).gate in s for p in c.subjects)))
    for field in ("kv_usage", "running", "waiting", "workers_healthy"):
        cond = getattr(when, f"pool_{field}")
        if cond is not None:
            out.append(_pool_num(f"pool.{field}", cond, lambda c, p, n=field: getattr(c.snap.pool(p), n)))
    for field in ("mean_accept_length", "rounds", "requests"):
        cond = getattr(when, f"stats_{field}")
        if cond is not None:
            out.append(_pool_num(f"stats.{field}", cond, lambda c, p, n=field: c.compiled.stat(c, p, n)))
    return out


class CompiledRule:
    __slots__ = ("rule", "preds", "fns", "subjects")

    def __init__(self, rule: Rule, policy: Policy) -> None:
        self.rule = rule
        when = rule.when
        self.preds = _rule_preds(when) if when is not None else []
        self.fns = tuple(fn for _, fn in self.preds)
        action = rule.then
        if when is not None and when.pool is not None:
            self.subjects = (when.pool,)
        elif isinstance(action, PoolAction):
            self.subjects = (action.pool,) if action.pool else tuple(action.pools or ())
        else:
            self.subjects = tuple(n for n, p in policy.pools.items() if p.proposer != "none")


class Compiled:
    """Per-policy precomputation: slice and rule predicates, pair versions, the plain pool."""

    def __init__(self, policy: Policy) -> None:
        self.slices = [(s.name, _feature_preds(s.when) if s.when is not None else []) for s in policy.slices]
        self.rules = [CompiledRule(r, policy) for r in policy.rules]
        # which slices, and whether any rule, test code_score (policies.slicing.needs_code_score)
        self.slice_reads_code = [s.when is not None and s.when.code_score is not None for s in policy.slices]
        self.rules_read_code = any(r.when is not None and r.when.code_score is not None for r in policy.rules)
        self.pair_versions = {name: policy.pool_pair_version(name) for name in policy.pools}
        self.plain_pools = [n for n, p in policy.pools.items() if p.proposer == "none"]
        self.speculative = [n for n, p in policy.pools.items() if p.proposer != "none"]
        # where a failed attempt moves on to (policies.decide.plan_attempts): every plain pool, then every
        # per-request pool with speculation off, each once
        self.fallback_pools = list(dict.fromkeys(
            self.plain_pools + [n for n, p in policy.pools.items() if p.speculation == "per_request"]))
        self.learning = policy.learning

    def stat(self, ctx: Ctx, pool: str, name: str) -> float | None:
        summary, factor = ctx.snap.acceptance(ctx.f.route, ctx.slice, pool, self.pair_versions[pool],
                                              self.learning.min_rounds)
        if summary is None:
            return None if name == "mean_accept_length" else 0.0
        if name == "mean_accept_length":
            return summary.mean_accept_length
        return (summary.rounds if name == "rounds" else summary.requests) * factor


def served_pools(policy: Policy) -> list[str]:
    """The pools the rules can serve, in the order the rules name them (``auto`` names every speculative
    pool in the policy's order). The gateway runs pair gates in this order, so a fresh gateway speculates as soon
    as its own pools pass; a pool only a condition or no rule names is not checked until a rule serves it or an
    operator asks: its canaries would load the workers users are on (on one shared CPU worker, requests ran 3-4x
    slower). ``specgate policy check`` lists the speculative pools it leaves out."""
    speculative = compiled(policy).speculative
    out: list[str] = []
    for rule in policy.rules:
        action = rule.then
        if isinstance(action, PoolAction):
            named = [action.pool] if action.pool else list(action.pools or ())
        elif action == "auto":
            named = speculative
        else:
            named = []
        out.extend(name for name in named if name not in out)
    return out


_CACHE: dict[int, Compiled] = {}


def compiled(policy: Policy) -> Compiled:
    """The cached compiled form of ``policy``."""
    key = id(policy)
    hit = _CACHE.get(key)
    if hit is None:
        hit = _CACHE[key] = Compiled(policy)
        weakref.finalize(policy, _CACHE.pop, key, None)
    return hit
