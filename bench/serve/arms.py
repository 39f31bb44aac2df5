"""The arms of the serving benchmark: one policy file each, under ``deploy/policies/bench/``.

The ``adaptive`` arms run ``deploy/policies/default.yaml`` itself: ``adaptive`` starts with a cold learner,
``adaptive-warm`` runs a warm-up pass on a fresh gateway first and is measured with what it learned.
Policy files name the worker ``http://127.0.0.1:30000`` and the converted model's revision; the harness
serves a copy with the benchmark worker's URL and the prepared model's revision, so a re-converted model
or a busy port 30000 cannot silently turn every arm into plain decoding.
The other arms' files are copies of the default policy's SLO, slices, pairs and pools (plus the arm's own pool,
where it has one) with the arm's rule: a change to the default's pairs or pools goes into each of them too
(tests/bench/test_serve_arms.py fails until it does).

``ngram-k16-beta`` and ``ngram-k7-sglang`` let the worker pick k every round (specgate's controller,
SGLang's); both keep engine-wide state in the shared worker for the whole run (the pooled acceptance per
n-gram match length; SGLang's EMA), as a production worker would. ``ngram-k8-vllm`` reads k off the number of
running sequences, vLLM's per-batch-size table as ``python -m bench.replay_adaptive`` tunes it on this
machine's costs (its policy file's header).

``suffix`` and ``suffix-k16`` (suffix decoding, k = 8 and 16) are the arms whose proposer keeps state across
requests: a global tree
of earlier outputs per scope, which the gateway sets to the request's route. Every cell of the run (load point,
slice, replicate) serves the same prompts again, so in one scope a later cell would draft from the earlier
cells' answers to them. The arm's served policy therefore has a route per cell (:func:`served_policy`, a key
file each) and the client sends each cell's key: every cell starts from an empty tree, as on a fresh worker and
in replay, and its requests still draft from each other's outputs.

``suffix-warm`` and ``suffix-k16-warm`` are those arms warmed up as ``adaptive-warm`` is, on one route: their
tree holds the warm-up's answers, as the default policy's ``hybrid`` pool's does in ``adaptive-warm``, so the two
compare like with like (run one load point per run with ``--restart worker``: the measured cells share the tree).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH_POLICIES = REPO / "deploy" / "policies" / "bench"
DEFAULT_POLICY = REPO / "deploy" / "policies" / "default.yaml"
POLICY_WORKER = "http://127.0.0.1:30000"
_REVISION = re.compile(r'revision: "sha256:[0-9a-f]+"')


@dataclass(frozen=True)
class Arm:
    name: str
    policy: Path
    warm: bool = False  # run a warm-up pass on the same gateway before measuring
    cell_scopes: bool = False  # each cell (load, slice, replicate) its own route, so its own suffix scope


ARMS: dict[str, Arm] = {
    **{name: Arm(name, BENCH_POLICIES / f"{name}.yaml", cell_scopes=name.startswith("suffix"))
       for name in ("plain", "ngram-k2", "ngram-k4", "ngram-k8", "suffix", "suffix-k16", "draft-k2", "draft-k4",
                    "ngram-k16-beta", "ngram-k7-sglang", "ngram-k8-vllm")},
    **{f"{name}-warm": Arm(f"{name}-warm", BENCH_POLICIES / f"{name}.yaml", warm=True)
       for name in ("suffix", "suffix-k16")},
    "adaptive": Arm("adaptive", DEFAULT_POLICY),
    "adaptive-warm": Arm("adaptive-warm", DEFAULT_POLICY, warm=True),
}


def parse_arms(names: list[str]) -> list[Arm]:
    """Arms in the order given; ``plain`` first when present (every arm's output is compared with it)."""
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise ValueError(f"--arms: unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    ordered = list(dict.fromkeys(names))
    if "plain" in ordered:
        ordered.remove("plain")
        ordered.insert(0, "plain")
    return [ARMS[n] for n in ordered]


_GATES = re.compile(r"^gates:.*?(?=^\S)", re.M | re.S)
_GATE_RULE = re.compile(r"^\s*- \{.*\bpair_gate:.*\}[^\n]*\n", re.M)


def without_gates(text: str) -> str:
    """A policy file's text without its top-level ``gates:`` section: a benchmark measures the policy's
    decisions on a pair already rolled out, not the rollout (canaries, the serving ramp's plain share). Rules
    conditioned on ``pair_gate`` go with it (one line each, as the repository's policies write them): without
    gates their condition never holds, and ``policy check`` refuses them."""
    if "\ngates:" not in text:
        return text
    ended = text if text.endswith("\n") else text + "\n"
    return _GATE_RULE.sub("", _GATES.sub("", ended + "#\n")[:-2])  # "#": a line for the lookahead at the end


def served_policy(arm: Arm, worker_url: str, revision: str, out_dir: Path, cells: list[str] = ()) -> Path:
    """Write the arm's policy pointed at ``worker_url`` with ``revision``, without its ``gates:``; returns the
    copy's path. ``cells``: one route per cell, ``cell-N`` for ``cells[N]``, its key (:func:`cell_key`) in a
    file beside the copy, and the default route for requests without a key."""
    text = without_gates(arm.policy.read_text(encoding="utf-8"))
    if POLICY_WORKER not in text:
        raise ValueError(f"{arm.policy}: expected worker URL {POLICY_WORKER} to replace with the bench worker")
    text = _REVISION.sub(f'revision: "{revision}"', text.replace(POLICY_WORKER, worker_url))
    if cells:
        if re.search(r"^routes:", text, re.M):
            raise ValueError(f"{arm.policy}: a per-cell arm's policy must not have routes of its own")
        lines = ["", "routes:  # one per benchmark cell (bench/serve/arms.py): each cell its own suffix scope"]
        for n, cell in enumerate(cells):
            key_file = out_dir / f"policy-{arm.name}-cell-{n}.keys"
            key_file.write_text(f"# {cell}\n{cell_key(arm.name, n)}\n", encoding="utf-8")
            lines.append(f"  - {{name: cell-{n}, api_keys_file: {key_file.name}}}")
        lines.append("  - {name: default}")
        text = text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"
    path = out_dir / f"policy-{arm.name}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def cell_key(arm: str, n: int) -> str:
    """The API key of an arm's cell route (loopback only, for one run)."""
    return f"bench-{arm}-cell-{n}"
