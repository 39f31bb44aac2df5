"""The serving benchmark's arms: every arm's policy file is valid and differs from the default policy only
where its header says (no processes are started)."""

from __future__ import annotations

import msgspec
import pytest
import yaml

from bench.serve.arms import (
    ARMS, DEFAULT_POLICY, check_repeats, parse_arms, route_key, served_policy, tree_notes, without_gates,
)
from backends.engine.types import SpeculationParams
from backends.worker.translate import speculation
from policies.decide import speculation_override
from policies.load import load_policy_file
from policies.schema import PoolAction

DEFAULT = load_policy_file(DEFAULT_POLICY)


def test_the_arms_in_order():
    assert list(ARMS) == ["plain", "ngram-k2", "ngram-k4", "ngram-k8", "suffix", "suffix-k16", "draft-k2",
                          "draft-k4", "ngram-k16-beta", "ngram-k7-sglang", "ngram-k8-vllm", "suffix-warm",
                          "suffix-k16-warm", "adaptive", "adaptive-warm"]
    assert [a.name for a in parse_arms(["suffix", "ngram-k8", "plain"])] == ["plain", "suffix", "ngram-k8"]


@pytest.mark.parametrize("name", [n for n in ARMS if not n.startswith("adaptive")])
def test_a_fixed_arm_is_the_default_policy_with_its_own_rules(name):
    """Same SLO, slices, pairs and pools as the default policy (the suffix arm adds its fixed-k pool on the
    default's suffix pair, the SGLang-controller and vLLM-table arms their pools)."""
    policy = load_policy_file(ARMS[name].policy)
    assert (policy.slo, policy.routes, policy.slices, policy.learning) == (
        DEFAULT.slo, DEFAULT.routes, DEFAULT.slices, DEFAULT.learning)
    pools, pairs = {"suffix": ({"suffix"}, set()), "suffix-k16": ({"suffix"}, set()),
                    "ngram-k7-sglang": ({"ngram-sglang"}, set()), "ngram-k8-vllm": ({"ngram-vllm"}, set())}.get(
        name.removesuffix("-warm"), (set(), set()))
    assert {n: p for n, p in policy.pools.items() if n not in pools} == DEFAULT.pools
    assert {n: p for n, p in policy.pairs.items() if n not in pairs} == DEFAULT.pairs
    assert set(policy.pools) - set(DEFAULT.pools) == pools and set(policy.pairs) - set(DEFAULT.pairs) == pairs
    [rule] = policy.rules
    assert rule.when is None and rule.name == f"bench-{name.removesuffix('-warm')}"


@pytest.mark.parametrize("name, k, warm", [("suffix", 8, False), ("suffix-k16", 16, False), ("suffix-warm", 8, True),
                                           ("suffix-k16-warm", 16, True)])
def test_a_suffix_arm_serves_every_request_by_suffix_decoding_with_its_k_on_the_embedded_worker(tmp_path, name, k,
                                                                                                warm):
    """k = 8 or 16; a warm variant is warmed up on its one route (its tree keeps the warm-up's answers, as the
    default policy's hybrid pool does in adaptive-warm), the others get a route per cell."""
    arm = ARMS[name]
    assert (arm.warm, arm.cell_scopes) == (warm, not warm)
    policy = load_policy_file(arm.policy)
    pool = policy.pools["suffix"]
    assert (pool.proposer, pool.speculation, pool.k_range, pool.pair) == ("suffix", "per_request", (1, k),
                                                                        "smollm2-suffix")
    assert policy.pairs["smollm2-suffix"].draft.kind == "suffix"
    assert policy.pairs["smollm2-suffix"].target == policy.pairs["smollm2-ngram"].target
    assert policy.rules[0].then == PoolAction(pool="suffix", draft_tokens=k)
    served = load_policy_file(served_policy(arm, "http://127.0.0.1:31234", "sha256:abc", tmp_path))
    assert {w for p in served.pools.values() for w in p.workers} == {"http://127.0.0.1:31234"}
    assert {p.target.revision for p in served.pairs.values()} == {"sha256:abc"}


def test_the_per_round_arms_serve_every_request_with_their_controller():
    beta, sglang = load_policy_file(ARMS["ngram-k16-beta"].policy), load_policy_file(ARMS["ngram-k7-sglang"].policy)
    assert beta.rules[0].then == PoolAction(pool="ngram-adaptive", draft_tokens=16)
    assert (beta.pools["ngram-adaptive"].strategy, beta.pools["ngram-adaptive"].k_range) == ("beta", (16, 16))
    assert sglang.rules[0].then == PoolAction(pool="ngram-sglang", draft_tokens=7)
    pool = sglang.pools["ngram-sglang"]
    assert (pool.adaptive, pool.strategy, pool.k_range, pool.speculation) == (True, "sglang", (7, 7), "per_request")
    vllm = load_policy_file(ARMS["ngram-k8-vllm"].policy)
    assert vllm.rules[0].then == PoolAction(pool="ngram-vllm", draft_tokens=8)
    pool = vllm.pools["ngram-vllm"]
    assert (pool.adaptive, pool.strategy, pool.k_range, pool.speculation) == (True, "vllm", (8, 8), "per_request")
    assert pool.batch_table == ((1, 8), (4, 4), (16, 1))


@pytest.mark.parametrize(("arm", "pool", "k", "extra", "table"), [
    ("ngram-k7-sglang", "ngram-sglang", 7, {"strategy": "sglang"}, ()),
    ("ngram-k8-vllm", "ngram-vllm", 8, {"strategy": "vllm", "k_by_batch": [[1, 8], [4, 4], [16, 1]]},
     ((1, 8), (4, 4), (16, 1))),
])
def test_a_peer_arm_tells_the_worker_its_controller_per_request(arm, pool, k, extra, table):
    """What the gateway sends in ``custom_params.speculation`` and what the worker makes of it: the peer's
    controller and table, over a worker launched with specgate's own controller and no table."""
    override = speculation_override(load_policy_file(ARMS[arm].policy), pool, k)
    sent = msgspec.json.decode(msgspec.json.encode(override))  # as it goes on the wire
    assert sent == {"proposer": "ngram", "draft_tokens": k, "adaptive": True, **extra}
    launched = SpeculationParams(proposer="ngram", draft_tokens=4)
    params = speculation({"speculation": sent}, launched, "")
    assert (params.proposer, params.draft_tokens, params.adaptive, params.strategy, params.k_by_batch) == (
        "ngram", k, True, extra["strategy"], table)


def test_without_gates_removes_exactly_the_default_policys_gates_section():
    text = DEFAULT_POLICY.read_text(encoding="utf-8")
    stripped = without_gates(text)
    original = yaml.safe_load(text)
    assert "gates" in original and "gates:" not in stripped
    # the rule conditioned on a pair gate goes too (without gates it never holds and policy check refuses it)
    gated = [r for r in original["rules"] if "pair_gate" in (r.get("when") or {})]
    assert [r["name"] for r in gated] == ["degraded-pair"]
    expected = {k: v for k, v in original.items() if k != "gates"}
    expected["rules"] = [r for r in original["rules"] if r not in gated]
    assert yaml.safe_load(stripped) == expected
    assert load_policy_file(DEFAULT_POLICY).gates is not None
    assert without_gates(stripped) == stripped
    # the section is the file's last: everything before it stays, down to its final newline
    assert stripped.endswith("acceptance collapse.\n")


@pytest.mark.parametrize("name", list(ARMS))
def test_every_arm_serves_a_policy_that_passes_policy_check(name, tmp_path):
    """What the harness hands each arm's gateway loads (a gated rule left behind once stopped every adaptive
    arm's gateway at start-up)."""
    served = load_policy_file(served_policy(ARMS[name], "http://127.0.0.1:31234", "sha256:abc", tmp_path))
    assert served.gates is None
    assert {w for p in served.pools.values() for w in p.workers} == {"http://127.0.0.1:31234"}


def test_without_gates_keeps_the_keys_after_the_section_and_leaves_a_policy_without_gates_alone():
    text = "version: 1\ngates:\n  serving: null\n  # a comment\n\n  outcome: {min_reports: 5}\nrules: []\n"
    assert without_gates(text) == "version: 1\nrules: []\n"
    assert without_gates("version: 1\ngates:\n  serving: null\n") == "version: 1\n"
    assert without_gates("version: 1\ngates: {}") == "version: 1\n"
    for arm in ARMS.values():
        if "\ngates:" not in (plain := arm.policy.read_text(encoding="utf-8")):
            assert without_gates(plain) == plain


def test_a_per_cell_arm_gets_a_route_per_cell_and_each_cells_key_maps_to_it(tmp_path):
    """Suffix decoding's tree is per scope = route: every cell (load, slice, replicate) of an arm whose tree would
    otherwise carry one cell's answers into the next (suffix, suffix-k16, and adaptive's hybrid pool) its own
    route, named after the arm, with its key in a file beside the served policy. The gateway's own KeyRing maps
    each key to its route, and a request without a key to the default route."""
    from gateway.auth import KeyRing

    assert [a.name for a in ARMS.values() if a.cell_scopes] == ["suffix", "suffix-k16", "adaptive"]
    cells = ["c1 code rep 0", "c1 code rep 1", "c4 code rep 0"]
    path = served_policy(ARMS["suffix"], "http://127.0.0.1:31234", "sha256:abc", tmp_path, cells)
    served = load_policy_file(path)
    assert [(r.name, r.api_keys_file) for r in served.routes] == [
        ("suffix.cell-0", "policy-suffix.cell-0.keys"), ("suffix.cell-1", "policy-suffix.cell-1.keys"),
        ("suffix.cell-2", "policy-suffix.cell-2.keys"), ("default", None)]
    assert (tmp_path / "policy-suffix.cell-1.keys").read_text() == "# c1 code rep 1\nbench-suffix.cell-1\n"
    ring = KeyRing(served, base_dir=path.parent, environ={})
    assert ring.problems == []
    assert [ring.route_for(f"Bearer {route_key('suffix', n)}") for n in range(3)] == [
        "suffix.cell-0", "suffix.cell-1", "suffix.cell-2"]
    assert ring.route_for(None) == "default"
    # everything else is the arm's policy as before
    whole = load_policy_file(served_policy(ARMS["suffix"], "http://127.0.0.1:31234", "sha256:abc", tmp_path))
    assert (served.pools, served.rules, served.slices) == (whole.pools, whole.rules, whole.slices)


def test_no_two_arms_share_a_route_so_no_two_share_a_suffix_tree_on_a_shared_worker(tmp_path):
    """The worker keeps a tree per scope = route for every arm it serves (``--restart gateway``): every arm's served
    routes are its own, a warm arm's one route (warm-up and measured cells) included, and its key maps to it.
    (All arms once served ``default``, and suffix and suffix-k16 both ``cell-N``: the arm served second in a cell
    drafted from the first one's answers.)"""
    from gateway.auth import KeyRing

    cells = ["c1 code rep 0", "c4 code rep 0"]
    routes: dict[str, str] = {}
    for arm in ARMS.values():
        out = tmp_path / arm.name
        out.mkdir()
        path = served_policy(arm, "http://127.0.0.1:31234", "sha256:abc", out, cells if arm.cell_scopes else [])
        served = load_policy_file(path)
        ring = KeyRing(served, base_dir=path.parent, environ={})
        keys = [route_key(arm.name, n) for n in range(len(cells))] if arm.cell_scopes else [route_key(arm.name)]
        for key in keys:
            route = ring.route_for(f"Bearer {key}")
            assert route not in routes, f"{arm.name} and {routes.get(route)} share route {route}"
            routes[route] = arm.name
    assert routes["adaptive-warm"] == "adaptive-warm" and routes["adaptive.cell-1"] == "adaptive"
    assert len(routes) == sum(len(cells) if a.cell_scopes else 1 for a in ARMS.values())


def test_replicates_of_a_warm_arm_are_refused_naming_the_flag_and_the_arms():
    """A warm arm's cells share its tree, so a second replicate drafts from the first one's answers."""
    check_repeats(parse_arms(["suffix", "adaptive-warm", "suffix-warm"]), 1)
    check_repeats(parse_arms(["plain", "suffix", "adaptive"]), 3)
    with pytest.raises(ValueError) as err:
        check_repeats(parse_arms(["suffix", "adaptive-warm", "suffix-warm"]), 2)
    assert str(err.value).startswith("--repeats 2 with adaptive-warm, suffix-warm: a warm arm's cells share one "
                                     "suffix tree")
    assert "use --repeats 1" in str(err.value)


def test_the_cells_are_listed_in_the_order_the_run_serves_them():
    import argparse

    from bench.serve.run import Bench
    from bench.workloads import WorkItem

    items = [WorkItem(id=f"{s}-1", slice=s, source="x", messages=[{"role": "user", "content": "hi"}])
             for s in ("code", "prose")]
    args = argparse.Namespace(loads=["c1", "p0.5"], slices=["code", "prose"], repeats=2)
    assert Bench(args, items, [], "sha256:abc", {}).cells() == [
        "c1 code rep 0", "c1 code rep 1", "c1 prose rep 0", "c1 prose rep 1",
        "p0.5 code rep 0", "p0.5 code rep 1", "p0.5 prose rep 0", "p0.5 prose rep 1"]


def test_a_run_over_several_load_points_notes_that_its_warm_arms_trees_span_them():
    """The report says so where it matters, and only there: a warm arm and more than one load point."""
    assert tree_notes(parse_arms(["suffix", "adaptive"]), ["c1", "c4"]) == []
    assert tree_notes(parse_arms(["suffix-warm", "adaptive-warm"]), ["c4"]) == []
    [note] = tree_notes(parse_arms(["suffix", "suffix-warm", "adaptive-warm"]), ["c1", "c4", "p1"])
    assert note.startswith("suffix-warm, adaptive-warm: a warm arm keeps one suffix tree for the whole run, so from "
                           "c4 on its cells drafted from the earlier load points' answers to the same prompts")
