"""Shared by the tests of ``auto`` (policies/auto.py): a two-pool policy (plain, n-gram k=2), outcomes of each,
a learner fed with them, and the share of requests a snapshot sends to speculation."""

from __future__ import annotations

import math
import random

from policies.decide import decide
from policies.features import RequestFeatures
from policies.load import load_policy
from policies.snapshot import PoolState
from policies.stats import LearningState, Outcome

POLICY = """
version: 1
slices: [{name: code, when: {code_score: {gte: 0.5}}}, {name: prose}]
pairs:
  p: {target: {model: m, revision: REV}, draft: {kind: ngram}}
pools:
  plain: {proposer: none, workers: ["http://w:1"], speculation: per_request}
  ngram: {proposer: ngram, draft_tokens: {min: 2, max: 2}, pair: p, workers: ["http://w:1"], speculation: per_request}
rules: [{name: learned, then: auto}]
learning: {half_life_s: 100, min_gain: GAIN}
"""
PROSE, CODE = RequestFeatures(max_tokens=256), RequestFeatures(max_tokens=256, code_score=0.9)
HEALTHY = {"plain": PoolState(healthy=True), "ngram": PoolState(healthy=True, pair_verified=True)}


def policy(rev: str = "r1", gain: float = 1.05):
    return load_policy(POLICY.replace("REV", rev).replace("GAIN", repr(gain)), "t.yaml")


def plain(tpot: float, t: float = 0.0, concurrency: int = 1, slice_: str = "prose",
          repeat: float | None = None) -> Outcome:
    return Outcome(route="default", slice=slice_, pool="plain", completion_tokens=101, tpot_s=tpot, timestamp=t,
                   concurrency=concurrency, prompt_repeat=repeat)


def spec(tpot: float, pv: str, t: float = 0.0, concurrency: int = 1, slice_: str = "prose",
         repeat: float | None = None, plain_tpot: float | None = None) -> Outcome:
    return Outcome(route="default", slice=slice_, pool="ngram", pair_version=pv, proposer="ngram", draft_tokens=2,
                   completion_tokens=101, verify_ct=50, reached_per_position=[50, 40],
                   accepted_per_position=[40, 20], tpot_s=tpot, timestamp=t, concurrency=concurrency,
                   prompt_repeat=repeat, plain_tpot_s=plain_tpot)


def learned(p, outcomes) -> LearningState:
    state = LearningState(p.learning)
    for o in outcomes:
        state.record(o)
    return state


def share_speculating(p, snap, features=PROSE, n: int = 400, seed: int = 0, **kw) -> float:
    rng = random.Random(seed)
    return sum(not decide(p, features, snap, rng=rng, **kw).bypass for _ in range(n)) / n


def noisy(rng: random.Random, tpot: float) -> float:
    return tpot * math.exp(rng.gauss(0.0, 0.1))
