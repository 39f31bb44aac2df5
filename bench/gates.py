"""What the pair gates cost: how long the equivalence gate takes on the default canary set, and how
much slower user requests are while it runs.

    .venv/bin/python -m bench.gates [--requests 12] [--markdown FILE]

One real ``specgate worker`` (the real model) and one gateway on ``deploy/policies/default.yaml`` (its gates
section as shipped: the built-in canaries, 32 greedy tokens each, and the sampled check, 48 x 4 tokens per
side) start together. A closed-loop client (the official ``openai`` package) sends short plain requests
(``max_tokens`` 7: the default policy's tiny-budget rule serves them without speculation, so they measure the
worker's load, not speculation) from the gateway's start until every pool the rules serve has a verdict, then as many
again with no gate running. Printed: each pool's verdict and its run time (a pool no rule serves is not run), the
time from the gateway's start to the last verdict, and user latency p50/p90 during vs after, side by side in one
run.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import openai

from backends.engine.model_store import load_prepared
from bench.processes import ADMIN, MODEL, cpu_model, gateway, worker, write_policy
from gateway.gates.driver import UNSERVED

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Name three colours."


def _policy(url: str, revision: str, tmp: Path) -> Path:
    text = (REPO / "deploy/policies/default.yaml").read_text().replace("http://127.0.0.1:30000", url)
    text = re.sub(r'revision: "sha256:[0-9a-f]+"', f'revision: "{revision}"', text)
    return write_policy(tmp / "policy.yaml", text)


def _gates(gw: str) -> dict[str, dict]:
    pools = httpx.get(f"{gw}/admin/pools", headers=ADMIN, timeout=30).json()
    return {name: view["gate"] for name, view in pools.items() if view["gate"] is not None}


def _waits(name: str, gate: dict) -> bool:
    """A pool no rule serves: pending until one does (gateway/gates/driver.py), so no verdict to wait for."""
    return gate["state"] == "pending" and gate["reason"] == UNSERVED.format(pool=name)


def _settled(gates: dict[str, dict]) -> bool:
    return all(_waits(n, g) or g["state"] != "pending" and not g["running"] for n, g in gates.items())


def _latency(client: openai.OpenAI) -> float:
    t0 = time.perf_counter()
    client.chat.completions.create(model=MODEL, max_tokens=7, temperature=0,
                                   messages=[{"role": "user", "content": PROMPT}])
    return time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12, help="user requests after the gates settle (at least)")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up waiting for verdicts after this")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    revision = load_prepared().revision
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with worker(tmp, "--max-running-requests", "8") as url:
            client = openai.OpenAI(base_url="http://unused", api_key="unused", max_retries=0, timeout=300)
            _latency(client.with_options(base_url=f"{url}/v1"))  # warm the worker
            t_start = time.monotonic()
            with gateway(tmp, _policy(url, revision, tmp)) as gw:
                client = client.with_options(base_url=f"{gw}/v1")
                during: list[float] = []
                while not _settled(_gates(gw)):
                    if time.monotonic() - t_start > args.timeout:
                        raise SystemExit(f"no verdict after {args.timeout:g} s: {_gates(gw)}")
                    during.append(_latency(client))
                t_settled = time.monotonic() - t_start
                gates = _gates(gw)
                after = [_latency(client) for _ in range(max(args.requests, len(during)))]
    lines = [f"CPU: {cpu_model()}; default policy's gates; user requests max_tokens 7, plain, closed loop c1",
             "", "| pool | verdict | run time (s) | canaries | tokens | canary accept length | sampled p_min |",
             "|---|---|---|---|---|---|---|"]
    for name, g in sorted(gates.items()):
        if _waits(name, g):
            lines.append(f"| {name} | not run: no rule serves it | - | - | - | - | - |")
            continue
        v = g["verdict"] or {}
        accept = f"{v['accept_length']:.2f}" if v.get("accept_length") else "-"
        p = f"{v['sampled_p']:.2g}" if v.get("sampled_p") is not None else "-"
        lines.append(f"| {name} | {g['state']} | {v.get('seconds', 0):.1f} | {v.get('canaries', 0)} | "
                     f"{v.get('tokens', 0)} | {accept} | {p} |")
    lines += ["", f"gateway start -> every verdict: {t_settled:.1f} s", "",
              "| user requests | n | p50 (s) | p90 (s) |", "|---|---|---|---|"]
    for label, values in (("while the gates ran", during), ("after", after)):
        if values:
            lines.append(f"| {label} | {len(values)} | {_pct(values, 50):.3f} | {_pct(values, 90):.3f} |")
    if during and after:
        lines.append(f"\np50 while the gates ran / after: {_pct(during, 50) / _pct(after, 50):.2f}x")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
