"""What the gateway expects a pool's workers to report (``expected_pair``): the declared draft params
that workers report are compared; a change of them is a new topology, so a reload re-verifies the pools."""

from __future__ import annotations

from backends.sglang.pair import ExpectedPair, PairIdentity, pair_mismatches
from backends.sglang.wire import ServerInfo
from gateway.backend import expected_pair, topology
from policies.load import load_policy

POLICY = """version: 1
slices: [{name: prose}]
pairs:
  ng: {target: {model: m, revision: r1}, draft: {kind: ngram, params: {max_match_window_size: 4, match: latest,
       num_draft_tokens: 8}}}
  sx: {target: {model: m, revision: r1}, draft: {kind: suffix, params: {max_tree_depth: 16, min_token_prob: 0.2}}}
  e3: {target: {model: m}, draft: {kind: eagle3, model: e, params: {num_steps: 3, match: x}}}
pools:
  plain: {proposer: none, workers: ["http://w:1"]}
  ngram: {proposer: ngram, draft_tokens: 7, pair: ng, workers: ["http://w:2"]}
  suffix: {proposer: suffix, draft_tokens: 8, pair: sx, workers: ["http://w:3"], speculation: per_request}
  eagle3: {proposer: eagle3, draft_tokens: 3, pair: e3, workers: ["http://w:4"]}
"""


def test_declared_ngram_and_suffix_params_are_expected():
    policy = load_policy(POLICY, "p.yaml")
    assert expected_pair(policy, "plain") is None
    # num_draft_tokens is part of the version only: the pool's draft_tokens pins k
    assert expected_pair(policy, "ngram") == ExpectedPair(
        target_revision="r1", algorithm="NGRAM", draft_tokens=7,
        draft_params=(("match", "latest"), ("max_match_window_size", 4)))
    assert expected_pair(policy, "suffix") == ExpectedPair(
        target_revision="r1", algorithm="SUFFIX", draft_tokens=None,
        draft_params=(("max_tree_depth", 16), ("min_token_prob", 0.2)))
    # an EAGLE draft's params are free-form and never compared (its 'match' is not the n-gram one)
    assert expected_pair(policy, "eagle3") == ExpectedPair(
        draft_model_path="e", algorithm="EAGLE3", draft_tokens=3)


def test_a_suffix_worker_launched_with_other_settings_is_a_mismatch():
    expected = expected_pair(load_policy(POLICY, "p.yaml"), "suffix")
    worker = PairIdentity.from_info(ServerInfo(
        revision="r1", speculative_algorithm="SUFFIX", specgate_per_request_speculation=True,
        speculative_suffix_max_tree_depth=24, speculative_suffix_min_token_prob=0.2), None)
    assert pair_mismatches(expected, worker) == ["draft param max_tree_depth: declared 16, worker reports 24"]
    relaunched = PairIdentity.from_info(ServerInfo(
        revision="r1", speculative_algorithm=None, specgate_per_request_speculation=True,
        speculative_suffix_max_tree_depth=16, speculative_suffix_min_token_prob=0.2), None)
    assert pair_mismatches(expected, relaunched) == []


def test_a_change_of_draft_params_changes_the_topology():
    before = load_policy(POLICY, "p.yaml")
    after = load_policy(POLICY.replace("max_tree_depth: 16", "max_tree_depth: 24"), "p.yaml")
    assert topology(before) != topology(after)
    assert topology(before) == topology(load_policy(POLICY, "p.yaml"))
    assert hash(topology(before)) == hash(topology(load_policy(POLICY, "p.yaml")))
