"""Gateway integration helpers: policy files pointed at test workers, and a real `specgate serve`
process on a free loopback port (always stopped)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from tests.integration.worker_process import BIN, free_port, running

ADMIN_TOKEN = "test-admin-token"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}  # headers of the admin API
MODEL = "SmolLM2-135M-Instruct"  # the served model's name
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
learning: {{explore: 0.0}}
"""


def write_policy(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@contextlib.contextmanager
def gateway(tmp: Path, policy: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A real `specgate serve`; yields its base URL. /health answers once its pools were probed."""
    port = free_port()
    argv = [str(BIN / "specgate"), "serve", "--policy", str(policy), "--port", str(port),
            "--log-console", "--log-level", "warning", *flags]
    saved = dict(os.environ)
    os.environ.update({"SPECGATE_ADMIN_TOKEN": ADMIN_TOKEN, **(env or {})})
    try:
        with running(argv, f"http://127.0.0.1:{port}/health", tmp / f"gateway-{port}.log"):
            yield f"http://127.0.0.1:{port}"
    finally:
        os.environ.clear()
        os.environ.update(saved)
