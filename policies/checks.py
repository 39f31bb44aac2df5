"""File-wide policy checks: names that must exist, names that must be unique, rules that can never match.

Each problem is ``((line, col), yaml_path, message)``; :mod:`policies.load` formats them.
"""

from __future__ import annotations

from policies.schema import PROPOSER_KINDS, Policy, PoolAction, Rule, RuleWhen, SliceWhen
from policies.yamltree import Path, YamlTree

Problem = tuple[tuple[int, int], Path, str]


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _is_empty(when: SliceWhen | None) -> bool:
    return when is None or all(getattr(when, f) is None for f in when.__struct_fields__)


def check_policy(policy: Policy, tree: YamlTree) -> list[Problem]:
    out: list[Problem] = []

    def add(path: Path, message: str, key: bool = False) -> None:
        out.append(((tree.key_pos(path) if key else tree.value_pos(path)), path, message))

    pools = list(policy.pools)
    pairs = list(policy.pairs)
    routes = policy.route_names()
    slices = list(dict.fromkeys(s.name for s in policy.slices))

    def unknown(kind: str, name: str, declared: list[str]) -> str:
        return f"unknown {kind} '{name}'; declared {kind}s: " + (", ".join(declared) or "(none)")

    _check_unique(add, "routes", [r.name for r in policy.routes], "route")
    keyless = [i for i, r in enumerate(policy.routes) if not r.has_keys]
    for i in keyless[1:]:
        add(("routes", i), f"route '{policy.routes[i].name}' has no api keys, like route "
            f"'{policy.routes[keyless[0]].name}'; only one default (key-less) route is allowed: give it "
            "api_keys_env or api_keys_file")

    def check_when(base: Path, when: SliceWhen | None) -> None:
        if when is None:
            return
        for name in _as_list(when.route) if when.route is not None else []:
            if name not in routes:
                add(base + ("route",), unknown("route", name, routes))

    default_at = next((i for i, s in enumerate(policy.slices) if _is_empty(s.when)), None)
    if default_at is None:
        add(("slices",), "no default slice; add a last slice without 'when', e.g. {name: prose}")
    for i, slc in enumerate(policy.slices):
        check_when(("slices", i, "when"), slc.when)
        if default_at is not None and i > default_at:
            add(("slices", i), f"unreachable: slice '{slc.name}' comes after the default slice "
                f"'{policy.slices[default_at].name}' (slices[{default_at}]); move it up or remove it")

    plain = [n for n, p in policy.pools.items() if p.proposer == "none"]
    server_spec = [n for n, p in policy.pools.items() if p.proposer != "none" and p.speculation == "server"]
    if not plain and server_spec:
        add(("pools",), "no pool with proposer none, and pool(s) " + ", ".join(server_spec) +
            " cannot switch speculation off per request; declare a plain pool (bypass and the safety "
            "fallback need one)")
    for name, pool in policy.pools.items():
        if pool.pair is None:
            continue
        if pool.pair not in policy.pairs:
            add(("pools", name, "pair"), unknown("pair", pool.pair, pairs))
            continue
        kind = policy.pairs[pool.pair].draft.kind
        if pool.proposer != "none" and kind not in PROPOSER_KINDS[pool.proposer]:
            fits = [p for p, kinds in PROPOSER_KINDS.items() if kind in kinds]
            add(("pools", name, "proposer"), f"proposer {pool.proposer} cannot run pair '{pool.pair}' "
                f"(draft kind {kind}); use proposer " + " or ".join(fits))

    for i, name in enumerate(policy.tracing.routes or () if policy.tracing else ()):
        if name not in routes:
            add(("tracing", "routes", i), unknown("route", name, routes))

    _check_unique(add, "rules", [r.name for r in policy.rules], "rule")
    catch_all = None
    for i, rule in enumerate(policy.rules):
        base: Path = ("rules", i)
        if catch_all is not None:
            add(base, f"unreachable: rule '{rule.name}' comes after the catch-all rule "
                f"'{policy.rules[catch_all].name}' (rules[{catch_all}]); move it up or remove it")
        elif _is_empty(rule.when):
            catch_all = i
        _check_rule(add, base, rule, policy, pools, unknown, slices)
        check_when(base + ("when",), rule.when)
    return out


def _check_unique(add, section: str, names: list[str], kind: str) -> None:
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            add((section, i, "name"), f"duplicate {kind} name '{name}' (also {section}[{seen[name]}]); "
                f"{kind} names must be unique")
        else:
            seen[name] = i


def _check_rule(add, base: Path, rule: Rule, policy: Policy, pools: list[str], unknown, slices: list[str]) -> None:
    when: RuleWhen | None = rule.when
    if when is not None:
        if when.pool is not None and when.pool not in policy.pools:
            add(base + ("when", "pool"), unknown("pool", when.pool, pools))
        for name in _as_list(when.slice) if when.slice is not None else []:
            if name not in slices:
                add(base + ("when", "slice"), unknown("slice", name, slices))
        if when.pair_gate is not None and policy.gates is None:
            add(base + ("when", "pair_gate"), "pair_gate needs a gates: section (without one no gate runs and the "
                "condition never holds); add gates: {} for the defaults, or remove the condition")
    action = rule.then
    if not isinstance(action, PoolAction):
        return
    if action.pool is not None:
        targets: list[tuple[Path, str]] = [(base + ("then", "pool"), action.pool)]
    else:
        targets = [(base + ("then", "pools", j), n) for j, n in enumerate(action.pools or [])]
    for path, name in targets:
        if name not in policy.pools:
            add(path, unknown("pool", name, pools))
            continue
        pool = policy.pools[name]
        if pool.proposer == "none":
            add(path, f"pool '{name}' has proposer none; use then: bypass to serve without speculation")
        elif isinstance(action.draft_tokens, int):
            lo, hi = pool.k_range
            if not lo <= action.draft_tokens <= hi:
                add(base + ("then", "draft_tokens"), f"draft_tokens {action.draft_tokens} is outside pool "
                    f"'{name}' range {lo}..{hi}; pick a value in range or auto")
