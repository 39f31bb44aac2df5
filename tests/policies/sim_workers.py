"""Synthetic workers with known acceptance curves and cost curves, for the auto convergence test.

Each (slice, proposer) has a conditional acceptance curve a_j; a speculative round with k drafts accepts
draft j with probability a_j given 1..j-1 accepted, then commits one more token. A round costs
``base_ms + per_draft_ms * k``; plain decoding costs ``plain_ms`` per token. The best fixed configuration
is computed from the same numbers in closed form, so the test knows the right answer.
"""

from __future__ import annotations

import random

from policies.accept import expected_tokens
from policies.stats import Outcome

PLAIN_MS = 40.0
CURVES = {
    ("code", "ngram"): [0.92, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4],
    ("code", "draft_model"): [0.5, 0.4, 0.3, 0.3],
    ("prose", "ngram"): [0.25, 0.2, 0.15, 0.1, 0.1, 0.1, 0.1, 0.1],
    ("prose", "draft_model"): [0.35, 0.3, 0.3, 0.3],
}
ROUND_COST_MS = {"ngram": (44.0, 4.0), "draft_model": (44.0, 30.0)}  # (base, per draft token)
TOKENS = 64


def speedup(slice_: str, proposer: str, k: int) -> float:
    base, per = ROUND_COST_MS[proposer]
    e_p = expected_tokens(CURVES[(slice_, proposer)][:k])[k]
    return e_p * PLAIN_MS / (base + per * k)


def best_fixed(slice_: str, ranges: dict[str, tuple[str, int]], min_gain: float,
               grid: bool = False) -> tuple[str, int, float] | None:
    """(pool, k, speedup) of the best fixed configuration, or None when nothing beats plain by min_gain.
    ``grid``: only the draft lengths auto offers (1, 2, 4, ... and k_max: policies.auto.k_grid)."""
    best = None
    for pool, (proposer, k_max) in ranges.items():
        for k in range(1, k_max + 1):
            if grid and k != k_max and k & (k - 1):
                continue
            s = speedup(slice_, proposer, k)
            if best is None or s > best[2]:
                best = (pool, k, s)
    return best if best and best[2] >= min_gain else None


def serve(rng: random.Random, route: str, slice_: str, pool: str, proposer: str, k: int, pair_version: str,
          now: float) -> Outcome:
    """Run one synthetic request and report it the way the embedded worker does."""
    if proposer == "none" or k == 0:
        tpot = PLAIN_MS * rng.uniform(0.97, 1.03) / 1e3
        return Outcome(route=route, slice=slice_, pool=pool, completion_tokens=TOKENS, tpot_s=tpot,
                       ttft_s=0.1, e2e_s=0.1 + tpot * (TOKENS - 1), timestamp=now)
    curve = CURVES[(slice_, proposer)]
    reached, accepted = [0] * k, [0] * k
    produced = rounds = 0
    while produced < TOKENS - 1:
        rounds += 1
        for j in range(k):
            reached[j] += 1
            if rng.random() >= curve[j]:
                break
            accepted[j] += 1
            produced += 1
        produced += 1
    base, per = ROUND_COST_MS[proposer]
    tpot = (base + per * k) * rng.uniform(0.97, 1.03) * rounds / produced / 1e3
    return Outcome(route=route, slice=slice_, pool=pool, pair_version=pair_version, proposer=proposer,
                   draft_tokens=k, completion_tokens=produced + 1, verify_ct=rounds,
                   accepted_per_position=accepted, reached_per_position=reached, tpot_s=tpot, ttft_s=0.1,
                   e2e_s=0.1 + tpot * produced, timestamp=now)
