"""Where a pool's equivalence gate runs: the speculative side and its plain reference, per worker identity.

The plain reference of a pool is, in order: the same worker with speculation off (a ``per_request`` pool:
the embedded worker, told ``{"proposer": "none"}``), else a healthy worker of a plain pool (proposer
``none``) that reports the same target (model path and revision). A pool whose workers report more than
one identity is checked once per identity, on one worker of each; every one must pass. The speculative side
runs at the pool's largest draft length (its adaptive mode, for an adaptive pool).
"""

from __future__ import annotations

import time
from pathlib import Path

from gateway.backend import Backend
from gateway.gates.values import Verdict
from gateway.gates.canary import BUILTIN, Canary, Side, load_canaries, pick, run
from policies.decide import speculation_override
from policies.schema import Equivalence, Policy
from speculation import PLAIN_OVERRIDE


def canaries_of(policy: Policy, base_dir: Path) -> list[Canary]:
    """The canary set the policy names (``gates.equivalence.canaries``, relative to the policy file), else
    the built-in one. CanaryError when the file is unusable."""
    gates = policy.gates
    path = gates.equivalence.canaries if gates is not None else None
    if path is None:
        return list(BUILTIN)
    return load_canaries(Path(path) if Path(path).is_absolute() else base_dir / path)


def sides(policy: Policy, pool_name: str, backend: Backend) -> list[tuple[Side, Side]] | str:
    """(speculative, plain reference) per distinct worker identity of the pool, or why there is none."""
    now = time.monotonic()
    pool, spec = backend.pools[pool_name], policy.pools[pool_name]
    by_identity = {}
    for worker in pool.selectable(now):
        if worker.identity is not None:
            by_identity.setdefault(worker.identity, worker)
    if not by_identity:
        return f"pool '{pool_name}' has no healthy worker whose pair identity matches the policy"
    k = spec.k_range[1]
    override = speculation_override(policy, pool_name, k)
    plain_pools = [backend.pools[n] for n, p in policy.pools.items() if p.proposer == "none" and n in backend.pools]
    out = []
    for identity, worker in by_identity.items():
        model = backend.models.get(worker.url, "default")
        mine = Side(client=backend.client(worker.url), model=model, speculation=override)
        if override is not None:
            out.append((mine, Side(client=mine.client, model=model, speculation=PLAIN_OVERRIDE)))
            continue
        same = [w for p in plain_pools for w in p.selectable(now) if w.identity is not None
                and (w.identity.target_model_path, w.identity.target_revision)
                == (identity.target_model_path, identity.target_revision)]
        if not same:
            return (f"pool '{pool_name}' has no plain reference: no healthy worker of a plain pool (proposer "
                    f"none) serves its target {identity.target_model_path} (revision {identity.target_revision}); "
                    "add one, or its pair cannot pass the equivalence gate")
        ref = min(same, key=lambda w: w.score)
        out.append((mine, Side(client=backend.client(ref.url), model=backend.models.get(ref.url, model))))
    return out


async def check_pool(policy: Policy, pool_name: str, backend: Backend, canaries: list[Canary],
                     settings: Equivalence) -> Verdict:
    """Run the equivalence gate for ``pool_name`` on every identity its workers report."""
    found = sides(policy, pool_name, backend)
    if isinstance(found, str):
        return Verdict(passed=False, error=True, reason=found)
    chosen = pick(canaries, settings)
    verdicts = []
    for spec, plain in found:
        verdict = await run(spec, plain, chosen, settings)
        if verdict.error or not verdict.passed:
            return verdict
        verdicts.append(verdict)
    if len(verdicts) == 1:
        return verdicts[0]
    first = verdicts[0]
    return Verdict(passed=True, reason=f"{len(verdicts)} worker identities: " + "; ".join(v.reason for v in verdicts),
                   canaries=first.canaries, tokens=sum(v.tokens for v in verdicts), accept_length=first.accept_length,
                   histogram=first.histogram, sampled_p=min((v.sampled_p for v in verdicts if v.sampled_p is not None),
                                                            default=None),
                   sampled_positions=sum(v.sampled_positions for v in verdicts),
                   seconds=sum(v.seconds for v in verdicts), worker=first.worker)
