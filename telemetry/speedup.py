"""Realised speedup of speculation over plain decoding, per slice and load bucket (the dashboard's table).

For each finished request with a TPOT and a known load, ``sample`` gives its load bucket, whether it was
served speculatively, and its decode tokens and time: ``tokens = completion_tokens - 1`` (the gaps its TPOT
averages over) and ``seconds = tpot_s * tokens``. The history adds these up per time bucket and
(route, slice, load bucket, mode); ``cells`` turns the sums of a window into, per cell,

- the token-weighted mean TPOT of each side: sum(seconds) / sum(tokens), i.e. total decode time over
  total decode tokens (a long answer weighs as many tokens as it has);
- ``speedup`` = plain TPOT / speculative TPOT (> 1: speculation paid), None unless both sides have
  requests;
- ``estimated_speedup``: the same from the speculative requests alone, each against its worker's estimate of
  plain decoding for the same tokens (``RequestRecord.plain_tpot_s``, specgate's embedded worker):
  sum(plain estimate x tokens) / sum(seconds) over the requests that carry one, None without any. Where the
  policy serves a cell only speculatively (it learned plain loses there, from the same estimates), this is
  the cell's speedup; a real SGLang server sends no estimate.

Every request the policy served counts, explorations included (the table shows what the choices realised).
Load buckets are the learner's (``learning.concurrency_buckets``, 1, 2, 4, ... 64 by default, handed in
through ``PolicyView.load_buckets``) applied to the record's ``concurrency`` (the mean number of requests
the gateway had in flight over the request's life, itself included, rounded: what the learner buckets
by): a request falls in the first edge >= its concurrency, or above the last one. A cell is keyed by the
bucket's upper edge (``None`` above the last), so sums kept across a reload that changed the edges still
mean what they meant. Records without a concurrency are not counted here.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from telemetry.derive import is_speculative
from telemetry.record import RequestRecord

LOAD_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # policies.schema.Learning.concurrency_buckets' default
SPEED_FIELDS = ("spec_n", "spec_tokens", "spec_s", "plain_n", "plain_tokens", "plain_s", "est_n", "est_spec_s",
                "est_plain_s")
ALL_ROUTES = "*"


def load_edge(concurrency: int, edges: Sequence[int]) -> int | None:
    """Upper edge of the bucket ``concurrency`` falls in (the first edge >= it, the learner's
    ``bisect_left(edges, max(1, c))``), or None above the last edge."""
    i = bisect.bisect_left(edges, max(1, concurrency))
    return edges[i] if i < len(edges) else None


def sample(record: RequestRecord, edges: Sequence[int]) -> tuple[int | None, dict[str, float]] | None:
    """(load edge, sums to add) for one record, or None when it says nothing about speedup (not ok, no TPOT,
    fewer than 2 tokens, no concurrency)."""
    if (record.status != "ok" or record.tpot_s is None or record.concurrency is None
            or record.completion_tokens < 2):
        return None
    mode = "spec" if is_speculative(record) else "plain"
    tokens = record.completion_tokens - 1
    sums = {f"{mode}_n": 1, f"{mode}_tokens": tokens, f"{mode}_s": record.tpot_s * tokens}
    if mode == "spec" and record.plain_tpot_s is not None:
        sums.update(est_n=1, est_spec_s=record.tpot_s * tokens, est_plain_s=record.plain_tpot_s * tokens)
    return load_edge(record.concurrency, edges), sums


def load_label(edge: int | None, edges: Sequence[int]) -> str:
    """"1", "2", "3-4", ... ">64": the concurrencies a bucket holds, from the sorted ``edges``."""
    if edge is None:
        return f">{edges[-1]}" if edges else ">0"
    lower = max((e for e in edges if e < edge), default=0) + 1
    return str(edge) if lower >= edge else f"{lower}-{edge}"


def _edge_order(edge: int | None) -> tuple[bool, int]:
    return (edge is None, edge or 0)


def cells(sums: Mapping[tuple[str, str, int | None], Mapping[str, float]],
          edges: Sequence[int] = LOAD_BUCKETS) -> dict[str, Any]:
    """The table of one window. ``sums``: (route, slice, load edge) -> ``SPEED_FIELDS`` sums.

    Returns ``loads`` (the columns with any request, in load order: ``{"load", "max"}`` with ``max`` the
    upper edge, None above the last) and ``cells``, one per (route, slice, load) with any request, plus
    the same summed over routes under route ``"*"``; each has the counts ``spec_n``/``plain_n``, decode
    tokens ``spec_tokens``/``plain_tokens``, mean TPOTs ``spec_tpot_s``/``plain_tpot_s`` (None without
    requests), ``speedup``, and ``estimated_speedup`` with ``est_n``, the speculative requests behind it."""
    merged: dict[tuple[str, str, int | None], dict[str, float]] = {}
    for (route, slice_, edge), row in sums.items():
        for key in ((route, slice_, edge), (ALL_ROUTES, slice_, edge)):
            into = merged.setdefault(key, dict.fromkeys(SPEED_FIELDS, 0.0))
            for name in SPEED_FIELDS:
                into[name] += row.get(name, 0.0)
    known = sorted(set(edges) | {e for _, _, e in merged if e is not None})
    out: list[dict[str, Any]] = []
    for (route, slice_, edge), row in sorted(merged.items(), key=lambda kv: (*kv[0][:2], _edge_order(kv[0][2]))):
        if row["spec_n"] + row["plain_n"] == 0:
            continue
        spec = row["spec_s"] / row["spec_tokens"] if row["spec_tokens"] > 0 else None
        plain = row["plain_s"] / row["plain_tokens"] if row["plain_tokens"] > 0 else None
        out.append({"route": route, "slice": slice_, "load": load_label(edge, known), "max": edge,
                    "spec_n": int(row["spec_n"]), "plain_n": int(row["plain_n"]),
                    "spec_tokens": int(row["spec_tokens"]), "plain_tokens": int(row["plain_tokens"]),
                    "spec_tpot_s": spec, "plain_tpot_s": plain,
                    "speedup": plain / spec if spec and plain is not None else None,
                    "est_n": int(row["est_n"]),
                    "estimated_speedup": row["est_plain_s"] / row["est_spec_s"] if row["est_spec_s"] > 0 else None})
    present = sorted({c["max"] for c in out}, key=_edge_order)
    return {"loads": [{"load": load_label(e, known), "max": e} for e in present], "cells": out}


def add(into: dict[tuple[str, str, int | None], dict[str, float]],
        rows: Iterable[tuple[tuple[str, str, int | None], Mapping[str, float]]]) -> None:
    """Sum ``rows`` into ``into`` (both keyed by (route, slice, load edge))."""
    for key, row in rows:
        target = into.setdefault(key, dict.fromkeys(SPEED_FIELDS, 0.0))
        for name, value in row.items():
            target[name] += value
