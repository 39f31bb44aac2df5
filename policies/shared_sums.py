"""Merging the learner's decayed sums across the gateways of a fleet (pure; the Valkey I/O is gateway/fleet.py).

A decayed sum S referenced at t_ref is worth ``S * 2^(-(t - t_ref) / H)`` at any later t, so two replicas'
sums of the same key merge exactly: rescale the older one to the newer reference time and add (``merge``).
``ever_*`` counts are not decayed and simply add. Each replica publishes its *own* sums (never what it merged
from others), so a merged view is ``own + sum(others)`` and nothing is counted twice, however often a replica
republishes (after a store restart, or a reconnect). Explorations in flight merge the same way, as plain counts
(``sum_counts``).

Replicas' reference times are their own ``time.monotonic()``: on the wire they are wall-clock seconds
(``to_wire``/``from_wire`` shift by the process's ``wall - monotonic`` offset), so a merged sum is off by at
most the clocks' skew, which only shifts its decay by that much (2^(-skew/H): 0.01% for 100 ms at H = 600 s).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from policies.accept import AcceptanceSummary
from policies.snapshot import ArmSummary, Snapshot

TABLES = ("acceptance", "arms", "gaps")
Summary = AcceptanceSummary | ArmSummary
_TYPES: dict[str, type] = {"acceptance": AcceptanceSummary, "arms": ArmSummary, "gaps": ArmSummary}


def _scale(values: Iterable[float], f: float) -> list[float]:
    return [v * f for v in values]


def _add(a: list[float], b: list[float]) -> tuple[float, ...]:
    n = max(len(a), len(b))
    a, b = a + [0.0] * (n - len(a)), b + [0.0] * (n - len(b))
    return tuple(x + y for x, y in zip(a, b, strict=True))


def merge(a: Summary, b: Summary, half_life_s: float) -> Summary:
    """The sum of two summaries of one key, referenced at the later of their two reference times."""
    if b.t_ref > a.t_ref:
        a, b = b, a
    f = 2.0 ** (-(a.t_ref - b.t_ref) / half_life_s)  # b rescaled to a's reference time
    if isinstance(a, ArmSummary):
        assert isinstance(b, ArmSummary)
        return ArmSummary(t_ref=a.t_ref, w=a.w + b.w * f, sy=a.sy + b.sy * f, syy=a.syy + b.syy * f,
                          ever=a.ever + b.ever)
    assert isinstance(a, AcceptanceSummary) and isinstance(b, AcceptanceSummary)
    return AcceptanceSummary(
        t_ref=a.t_ref, requests=a.requests + b.requests * f, rounds=a.rounds + b.rounds * f,
        tokens=a.tokens + b.tokens * f, curve_rounds=a.curve_rounds + b.curve_rounds * f,
        reached=_add(list(a.reached), _scale(b.reached, f)), accepted=_add(list(a.accepted), _scale(b.accepted, f)),
        ever_requests=a.ever_requests + b.ever_requests, ever_rounds=a.ever_rounds + b.ever_rounds,
        ever_curve_rounds=a.ever_curve_rounds + b.ever_curve_rounds)


def sum_counts(*counts: Mapping[str, int]) -> dict[str, int]:
    """Per key, the sum of several replicas' counts (explorations in flight: the others', or own + the others');
    a key whose sum is not positive has nothing in flight and is left out."""
    total: dict[str, int] = {}
    for each in counts:
        for key, n in each.items():
            total[key] = total.get(key, 0) + n
    return {key: n for key, n in total.items() if n > 0}


def field_of(table: str, key: str) -> str:
    """The hash field one summary is stored under (keys hold labels and numbers only, never request text)."""
    return f"{table}\x1f{key}"


def to_wire(summary: Summary, offset: float) -> bytes:
    """One summary as stored: its reference time shifted to wall-clock seconds (``offset`` = wall - local)."""
    return msgspec.json.encode(msgspec.structs.replace(summary, t_ref=summary.t_ref + offset))


def from_wire(field: str | bytes, raw: bytes, offset: float) -> tuple[str, str, Summary] | None:
    """(table, key, summary in local time) of one stored field; None for a field this version does not know."""
    name = field.decode() if isinstance(field, bytes) else field
    table, _, key = name.partition("\x1f")
    kind = _TYPES.get(table)
    if kind is None or not key:
        return None
    try:
        summary = msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError:
        return None
    return table, key, msgspec.structs.replace(summary, t_ref=summary.t_ref - offset)


class Merger:
    """``own + others`` per table, cached per key: a key is re-merged only when its own summary object or the
    others' merged one changed (the learner replaces a key's frozen summary on every outcome it records)."""

    def __init__(self) -> None:
        self.others: dict[str, dict[str, Summary]] = {t: {} for t in TABLES}
        self._cache: dict[tuple[str, str], tuple[object, object, Summary]] = {}

    def set_others(self, replicas: Iterable[Mapping[str, Mapping[str, Summary]]], half_life_s: float) -> None:
        """The other replicas' own sums (each ``table -> key -> summary``), summed into one view."""
        merged: dict[str, dict[str, Summary]] = {t: {} for t in TABLES}
        for tables in replicas:
            for table, keys in tables.items():
                into = merged.setdefault(table, {})
                for key, summary in keys.items():
                    have = into.get(key)
                    into[key] = summary if have is None else merge(have, summary, half_life_s)
        self.others = merged
        self._cache.clear()

    def tables(self, own: Mapping[str, Mapping[str, Summary]], half_life_s: float) -> dict[str, dict[str, Summary]]:
        """The fleet's view: every key of ``own`` and of the others, summed."""
        out: dict[str, dict[str, Summary]] = {}
        for table in TABLES:
            mine, theirs = own.get(table, {}), self.others.get(table, {})
            if not theirs:
                out[table] = dict(mine)
                continue
            view = dict(theirs)
            for key, summary in mine.items():
                other = theirs.get(key)
                if other is None:
                    view[key] = summary
                    continue
                cached = self._cache.get((table, key))
                if cached is not None and cached[0] is summary and cached[1] is other:
                    view[key] = cached[2]
                    continue
                both = merge(summary, other, half_life_s)
                self._cache[(table, key)] = (summary, other, both)
                view[key] = both
            out[table] = view
        return out

    def snapshot(self, snap: Snapshot, own: Mapping[str, Mapping[str, Summary]]) -> Snapshot:
        """``snap`` (built from this replica's own sums ``own``) deciding from the fleet's evidence instead:
        its tables replaced by own + the others' (``snap`` itself when no other replica published any)."""
        if not any(self.others.values()):
            return snap
        tables = self.tables(own, snap.data.half_life_s)
        return Snapshot(msgspec.structs.replace(snap.data, acceptance=tables["acceptance"], arms=tables["arms"],
                                                gaps=tables["gaps"]))
