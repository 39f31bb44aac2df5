"""Synthetic gateway traffic for the dashboard tests: plausible records and pool states over time.

Seeded, so a screenshot of the same run is reproducible; the shapes (code accepts more than prose,
acceptance falls with draft position, speculation lowers TPOT) are what a person expects to see.
"""

from __future__ import annotations

import random

from policies.schema import Policy
from telemetry.record import RequestRecord
from telemetry.views import PoolView, WorkerView

# probability that draft position j is accepted given the previous ones were, per slice
ACCEPT = {"code": (0.85, 0.75, 0.65, 0.55), "prose": (0.55, 0.4, 0.3, 0.2), "tool_call": (0.8, 0.7, 0.6, 0.5)}


def speculative_record(rng: random.Random, *, request_id: str, route: str, slice_: str, pool: str,
                       proposer: str, rule: str, k: int, at: float, slo_tpot_s: float,
                       exploration: str | None = None, concurrency: int | None = None,
                       plain_estimate: bool = False) -> RequestRecord:
    """One speculative request whose per-position counts come from simulated rounds; ``plain_estimate``: its
    worker estimated plain decoding's TPOT for it (specgate's embedded worker: 1.5x its own)."""
    rounds = rng.randint(8, 24)
    accepted = [0] * k
    reached = [0] * k
    completion = 0
    for _ in range(rounds):
        for j in range(k):
            reached[j] += 1
            if rng.random() >= ACCEPT[slice_][min(j, 3)]:
                break
            accepted[j] += 1
        completion += 1
    completion += sum(accepted)
    tpot = rng.uniform(0.012, 0.03) * (1.6 if slice_ == "prose" else 1.0)
    ttft = rng.uniform(0.08, 0.4)
    return RequestRecord(
        request_id=request_id, route=route, slice=slice_, pool=pool, proposer=proposer, rule=rule,
        draft_tokens=k, prompt_tokens=rng.randint(50, 900), completion_tokens=completion, ttft_s=ttft,
        tpot_s=tpot, e2e_s=ttft + tpot * (completion - 1), verify_ct=rounds, num_correct_drafts=sum(accepted),
        num_proposed_drafts=rounds * k, accept_length=completion / rounds, accepted_per_position=accepted,
        reached_per_position=reached, slo_ttft_s=0.5, slo_tpot_s=slo_tpot_s,
        slo_met=ttft <= 0.5 and tpot <= slo_tpot_s, timestamp=at, overhead_s=rng.uniform(0.0005, 0.003),
        exploration=exploration, concurrency=concurrency, plain_tpot_s=1.5 * tpot if plain_estimate else None)


def plain_record(rng: random.Random, *, request_id: str, route: str, slice_: str, rule: str, at: float,
                 slo_tpot_s: float, status: str = "ok", concurrency: int | None = None) -> RequestRecord:
    completion = rng.randint(20, 200)
    tpot = rng.uniform(0.025, 0.05)
    ttft = rng.uniform(0.08, 0.6)
    ok = status == "ok"
    return RequestRecord(
        request_id=request_id, route=route, slice=slice_, pool="plain", proposer="none", rule=rule,
        status=status, http_status=200 if ok else 502, error_type=None if ok else "upstream_error",
        error_message=None if ok else "worker http://127.0.0.1:30000 closed the connection",
        prompt_tokens=rng.randint(50, 900), completion_tokens=completion if ok else 0,
        ttft_s=ttft if ok else None, tpot_s=tpot if ok else None,
        e2e_s=ttft + tpot * (completion - 1) if ok else 0.05, slo_ttft_s=0.5, slo_tpot_s=slo_tpot_s,
        slo_met=(ttft <= 0.5 and tpot <= slo_tpot_s) if ok else None, timestamp=at, concurrency=concurrency)


def traffic(policy: Policy, rng: random.Random, start: float, end: float, per_s: float = 2.0) -> list[RequestRecord]:
    """Records spread over [start, end): code on ngram (with the worker's plain estimates), tool calls on draft
    (without), prose mostly plain; the load each saw cycles through 1, 2, 3, 6 and 12 requests in flight (by
    request number: the seeded draws stay the same)."""
    records: list[RequestRecord] = []
    t, n = start, 0
    while t < end:
        n += 1
        route = rng.choice(("ide", "ide", "chat"))
        slo_tpot = policy.route_slo(route).tpot_ms / 1e3
        slice_ = rng.choice(("code", "code", "prose", "tool_call"))
        rid = f"req-{n:05d}"
        load = (1, 2, 3, 6, 12)[n % 5]
        if slice_ == "code":
            records.append(speculative_record(rng, request_id=rid, route=route, slice_=slice_, pool="ngram",
                                              proposer="ngram", rule="code-ngram", k=4, at=t, slo_tpot_s=slo_tpot,
                                              concurrency=load, plain_estimate=True))
        elif slice_ == "tool_call" or rng.random() < 0.3:
            records.append(speculative_record(rng, request_id=rid, route=route, slice_=slice_, pool="draft",
                                              proposer="draft_model", rule="learned", k=3, at=t, slo_tpot_s=slo_tpot,
                                              exploration="thompson" if rng.random() < 0.2 else None,
                                              concurrency=load))
        else:
            status = "upstream_error" if rng.random() < 0.03 else "ok"
            rule = "kv-pressure" if rng.random() < 0.2 else "learned"
            records.append(plain_record(rng, request_id=rid, route=route, slice_=slice_, rule=rule, at=t,
                                        slo_tpot_s=slo_tpot, status=status, concurrency=load))
        t += rng.expovariate(per_s)
    return records


def pool_state(policy: Policy, rng: random.Random) -> list[PoolView]:
    """Every policy pool with healthy workers and a load drawn from ``rng`` (it drifts call by call)."""
    views: list[PoolView] = []
    for name, pool in policy.pools.items():
        states = tuple(
            WorkerView(url=url, healthy=True, running=rng.randint(0, 8), waiting=rng.randint(0, 3),
                       kv_usage=round(0.3 + 0.25 * rng.random() + (0.2 if name == "ngram" else 0), 3))
            for url in pool.workers)
        views.append(PoolView(
            name=name, workers=len(states), healthy_workers=len(states),
            running=sum(w.running or 0 for w in states), waiting=sum(w.waiting or 0 for w in states),
            in_flight=rng.randint(0, 4), kv_usage=max(w.kv_usage or 0.0 for w in states),
            accept_length=None if pool.proposer == "none" else round(rng.uniform(1.8, 3.2), 2),
            pair_verified=None if pool.proposer == "none" else True, worker_states=states))
    return views
