"""A seeded stream of outcomes (plain and speculative, two slices, three loads) for the shared-sums tests."""

from __future__ import annotations

import random

from policies.stats import Outcome


def stream(n: int, seed: int = 7) -> list[Outcome]:
    rng = random.Random(seed)
    out, t = [], 1000.0
    for i in range(n):
        t += rng.uniform(0.0, 3.0)
        spec = i % 3 != 0
        out.append(Outcome(route="r", slice=rng.choice(["code", "prose"]), pool="ngram" if spec else "plain",
                           pair_version="v1" if spec else "", proposer="ngram" if spec else "none",
                           draft_tokens=4 if spec else 0, completion_tokens=rng.randint(2, 60),
                           verify_ct=rng.randint(1, 20) if spec else 0,
                           correct_drafts_histogram=[rng.randint(0, 5) for _ in range(5)] if spec else [],
                           tpot_s=rng.uniform(0.005, 0.05), timestamp=t, concurrency=rng.choice([1, 3, 9])))
    return out
