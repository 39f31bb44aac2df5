"""Decision latency: `decide()` with a 50-rule policy and warm statistics.

Run: .venv/bin/python -m bench.policy [--decisions 20000]
Prints the command, Python version, CPU, the policy used, and p50/p99 of one decide() call (target p99 < 50 us).
The snapshot is built once (the gateway rebuilds it when statistics change, not per request); each
request has different features, so slicing and the 50 rules are evaluated every time.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time

from bench.processes import cpu_model
from policies.decide import decide
from policies.features import RequestFeatures
from policies.load import load_policy
from policies.snapshot import PoolState
from policies.stats import LearningState, Outcome

HEAD = """
version: 1
slices:
  - {name: tool_call, when: {has_tools: true}}
  - {name: long_context, when: {prompt_tokens: {gte: 1500}}}
  - {name: code, when: {code_score: {gte: 0.5}}}
  - {name: prose}
pairs:
  pn: {target: {model: m, revision: r}, draft: {kind: ngram}}
  pd: {target: {model: m, revision: r}, draft: {kind: layer_truncated, layers: 8}}
pools:
  plain: {proposer: none, workers: ["http://w:1"], speculation: per_request}
  ngram: {proposer: ngram, draft_tokens: {min: 1, max: 8}, pair: pn, workers: ["http://w:1"], speculation: per_request}
  draft: {proposer: draft_model, draft_tokens: {min: 1, max: 4}, pair: pd, workers: ["http://w:1"], speculation: per_request}
rules:
  - {name: unverified-pair, when: {pair_verified: false}, then: bypass}
  - {name: kv-pressure, when: {pool.kv_usage: {gte: 0.9}}, then: bypass}
"""


def build_policy(n_rules: int = 50) -> str:
    """Two safety rules, 47 header/feature rules that rarely match, and the auto catch-all."""
    rules = [f"  - {{name: r{i}, when: {{headers: {{x-tenant: t{i}}}, max_tokens: {{gte: {i}}}, "
             f"slice: [code, prose]}}, then: {{pool: ngram, draft_tokens: {1 + i % 8}}}}}"
             for i in range(n_rules - 3)]
    return HEAD + "\n".join(rules) + "\n  - {name: learned, then: auto}\nlearning: {min_rounds: 50}\n"


def warm_state(policy, rng: random.Random) -> LearningState:
    state = LearningState(policy.learning)
    for i in range(2000):
        slice_ = ("code", "prose", "tool_call", "long_context")[i % 4]
        pool = ("plain", "ngram", "draft")[i % 3]
        k = 0 if pool == "plain" else rng.randint(1, 4)
        reached = [40 - 5 * j for j in range(k)]
        state.record(Outcome(route="default", slice=slice_, pool=pool, pair_version=policy.pool_pair_version(pool),
                             proposer=policy.pools[pool].proposer, draft_tokens=k, completion_tokens=80,
                             verify_ct=40 if k else 0, reached_per_position=reached,
                             accepted_per_position=[r * 3 // 4 for r in reached], tpot_s=0.03 + 0.005 * k,
                             concurrency=rng.randint(1, 8), timestamp=i * 0.01))
    return state


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decisions", type=int, default=20000)
    args = parser.parse_args()
    rng = random.Random(0)
    policy = load_policy(build_policy(), "bench-50-rules.yaml")
    assert len(policy.rules) == 50
    state = warm_state(policy, rng)
    pools = {n: PoolState(healthy=True, pair_verified=True, kv_usage=0.3) for n in policy.pools}
    snap = state.snapshot(20.0, pools, 4)
    requests = [RequestFeatures(code_score=rng.random(), prompt_tokens=rng.randint(10, 3000),
                                max_tokens=rng.randint(1, 512), has_tools=rng.random() < 0.2,
                                headers={"x-tenant": f"u{rng.randint(0, 99)}"}) for _ in range(1000)]
    explore_rng = random.Random(1)
    for f in requests:  # warm-up: compiled policy, snapshot memo
        decide(policy, f, snap, rng=explore_rng)
    times = []
    clock = time.perf_counter_ns
    for i in range(args.decisions):
        f = requests[i % len(requests)]
        t0 = clock()
        decide(policy, f, snap, rng=explore_rng)
        times.append(clock() - t0)
    times.sort()
    p50, p99 = times[len(times) // 2] / 1e3, times[int(len(times) * 0.99)] / 1e3
    build_t0 = time.perf_counter()
    cold = state.snapshot(21.0, pools, 4)
    decide(policy, requests[0], cold)
    cold_us = (time.perf_counter() - build_t0) * 1e6
    print(f"command: {' '.join([sys.executable, '-m', 'bench.policy'] + sys.argv[1:])}")
    print(f"python {platform.python_version()} on {platform.processor() or platform.machine()} "
          f"({cpu_model()})")
    print(f"policy: 50 rules (2 safety, 47 header+budget+slice rules, auto catch-all), 4 slices, 3 pools; "
          f"2000 warm outcomes; {args.decisions} decisions over 1000 distinct requests")
    print(f"decide() latency: p50 {p50:.1f} us, p99 {p99:.1f} us (target p99 < 50 us)")
    print(f"fresh snapshot + first decide (memo cold): {cold_us:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
