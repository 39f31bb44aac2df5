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

Suffix decoding keeps state across requests: a global tree of earlier outputs per scope, which the gateway sets
to the request's route, and the worker holds every scope of every arm it serves. So every arm serves its own
routes (:func:`served_policy`, each with a key file, and the client sends the key): on the shared worker of
``--restart gateway`` no arm drafts from another arm's answers to the same prompts (before 2026-12-07 all arms
served the route ``default``, and the cell routes ``cell-N`` of ``suffix`` and ``suffix-k16`` had the same names,
so the arm served second in a cell drafted from the first one's answers).

``suffix``, ``suffix-k16`` and ``adaptive`` (whose default policy's ``hybrid`` pool drafts from the tree too) have
a route per cell: every cell of the run (load point, slice, replicate) serves the same prompts again, so in one
scope a later cell would draft from the earlier cells' answers to them. Every cell starts from an empty tree, as
on a fresh worker and in replay, and its requests still draft from each other's outputs. (``adaptive``'s learner
is the gateway's and keeps learning across cells; only the tree starts empty.)

``suffix-warm``, ``suffix-k16-warm`` and ``adaptive-warm`` are warmed up on their one route: their tree holds the
warm-up's answers, so the three compare like with like, and the measured cells share that tree. A replicate would
draft from the previous one's answers to the same prompts (measured: c4 TPOT 0.52x the first replicate), so
:func:`check_repeats` refuses ``--repeats`` above 1 with them; a second load point drafts from the first one's
answers alike (run one load point per command with ``--restart worker``, as docs/benchmarks.md's do).
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
    "adaptive": Arm("adaptive", DEFAULT_POLICY, cell_scopes=True),
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


def check_repeats(arms: list[Arm], repeats: int) -> None:
    """Refuse replicates of a warm arm: its cells share one suffix tree, so a replicate drafts from the previous
    one's answers to the same prompts and is no replicate (module docstring)."""
    warm = [a.name for a in arms if a.warm]
    if repeats > 1 and warm:
        raise ValueError(f"--repeats {repeats} with {', '.join(warm)}: a warm arm's cells share one suffix tree, so "
                         "each replicate would draft from the previous one's answers to the same prompts (c4 TPOT "
                         "0.52x the first replicate); use --repeats 1 and run the command again for a second "
                         "replicate, or leave the warm arms out")


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
    copy's path. Its routes are the arm's own (module docstring), each with its key (:func:`route_key`) in a file
    beside the copy: ``ARM.cell-N`` for ``cells[N]`` when ``cells`` are given, else one route ``ARM``; and the
    default route for requests without a key."""
    text = without_gates(arm.policy.read_text(encoding="utf-8"))
    if POLICY_WORKER not in text:
        raise ValueError(f"{arm.policy}: expected worker URL {POLICY_WORKER} to replace with the bench worker")
    if re.search(r"^routes:", text, re.M):
        raise ValueError(f"{arm.policy}: an arm's policy must not have routes of its own (the harness gives each "
                         "arm its own, so that no two arms share a suffix tree)")
    text = _REVISION.sub(f'revision: "{revision}"', text.replace(POLICY_WORKER, worker_url))
    lines = ["", "routes:  # the arm's own (bench/serve/arms.py): its own suffix scopes on a shared worker"]
    for n, label in enumerate(cells or [f"every cell of {arm.name}"]):
        name = route_name(arm.name, n if cells else None)
        key_file = out_dir / f"policy-{name}.keys"
        key_file.write_text(f"# {label}\n{route_key(arm.name, n if cells else None)}\n", encoding="utf-8")
        lines.append(f"  - {{name: {name}, api_keys_file: {key_file.name}}}")
    lines.append("  - {name: default}")
    text = text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"
    path = out_dir / f"policy-{arm.name}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def tree_notes(arms: list[Arm], loads: list[str]) -> list[str]:
    """What a reader of the run's report must know of its suffix trees: a warm arm keeps one for the whole run, so
    past the first load point its cells draft from the earlier points' answers to the same prompts (module
    docstring), unlike the arms with a route per cell."""
    warm = [a.name for a in arms if a.warm]
    if len(loads) < 2 or not warm:
        return []
    return [f"{', '.join(warm)}: a warm arm keeps one suffix tree for the whole run, so from {loads[1]} on its cells "
            "drafted from the earlier load points' answers to the same prompts; to compare it with the other arms "
            "there, run one load point per command (--loads X --restart worker)."]


def route_name(arm: str, cell: int | None = None) -> str:
    """The route (so the suffix scope) of an arm's cell ``cell``, or of all its cells (None)."""
    return arm if cell is None else f"{arm}.cell-{cell}"


def route_key(arm: str, cell: int | None = None) -> str:
    """The API key of :func:`route_name`'s route (loopback only, for one run)."""
    return f"bench-{route_name(arm, cell)}"
