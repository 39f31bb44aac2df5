"""Gateway integration test content: the policy pointed at test workers, the prompts the tests send, and what
the tests read off a worker (the tokens it generated).

The processes themselves (`specgate serve`, `specgate worker`) start through ``bench.processes``.
"""

from __future__ import annotations

import httpx


def generated_tokens(worker: str) -> int:
    """Every token the worker has generated since it started (``sglang:generation_tokens`` on /metrics): the
    difference across a scenario tells a request the worker aborted from one it ran to its ``max_tokens``."""
    text = httpx.get(f"{worker}/metrics", timeout=10).text
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("sglang:generation_tokens_total")))


# a prompt the default policy classifies as code (code_score >= 0.3)
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n# write mul(a, b) like above\n"


def policy_text(workers: list[str], *, revision: str, routes: str = "", extra_rules: str = "",
                long_context_tokens: int = 1500) -> str:
    urls = ", ".join(f'"{u}"' for u in workers)
    return f"""version: 1
slo: {{ttft_ms: 5000, tpot_ms: 500}}
{routes}
slices:
  - {{name: tool_call, when: {{has_tools: true}}}}
  - {{name: long_context, when: {{prompt_tokens: {{gte: {long_context_tokens}}}}}}}
  - {{name: code, when: {{code_score: {{gte: 0.3}}}}}}
  - {{name: prose}}
pairs:
  smollm2-ngram:
    target: {{model: SmolLM2-135M-Instruct, revision: "{revision}"}}
    draft: {{kind: ngram}}
pools:
  plain: {{proposer: none, workers: [{urls}], speculation: per_request}}
  ngram:
    proposer: ngram
    draft_tokens: {{min: 1, max: 8}}
    pair: smollm2-ngram
    workers: [{urls}]
    speculation: per_request
rules:
  - {{name: unverified-pair, when: {{pair_verified: false}}, then: bypass}}
{extra_rules}  - {{name: code-ngram, when: {{slice: code}}, then: {{pool: ngram, draft_tokens: 4}}}}
  - {{name: tiny-budget, when: {{max_tokens: {{lt: 8}}}}, then: bypass}}
  - {{name: learned, then: auto}}
learning: {{half_life_s: 600}}
"""
