"""Every error class the loader reports, with the exact one-line message (file:line:col: path: what; fix)."""

from __future__ import annotations

import pytest

from policies.errors import PolicyError
from policies.load import load_policy

BASE = """version: 1
slices:
  - {name: code, when: {code_score: {gte: 0.5}}}
  - {name: prose}
pairs:
  p: {target: {model: m, revision: r1}, draft: {kind: ngram}}
pools:
  plain: {proposer: none, workers: ["http://w:1"]}
  ngram: {proposer: ngram, draft_tokens: 4, pair: p, workers: ["http://w:1"]}
rules:
  - {name: tiny, when: {max_tokens: {lt: 8}}, then: bypass}
  - {name: code-edits, when: {slice: code}, then: {pool: ngram, draft_tokens: 4}}
  - {name: learned, then: auto}
"""


def errors_of(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        load_policy(text, "p.yaml")
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors


def test_base_policy_is_valid() -> None:
    policy = load_policy(BASE, "p.yaml")
    assert list(policy.pools) == ["plain", "ngram"] and policy.default_route == "default"


@pytest.mark.parametrize("old, new, expected", [
    ("then: {pool: ngram, draft_tokens: 4}", "then: {pool: ngramm, draft_tokens: 4}",
     "p.yaml:12:58: rules[1] (Rule 'code-edits').then.pool: unknown pool 'ngramm'; declared pools: plain, ngram"),
    ("{name: tiny, when: {max_tokens: {lt: 8}}", "{name: tiny, when: {max_token: {lt: 8}}",
     "p.yaml:11:25: rules[0] (Rule 'tiny').when.max_token: unknown key 'max_token'; did you mean 'max_tokens'?"),
    ("draft_tokens: 4, pair", "draft_tokens: four, pair",
     "p.yaml:9:42: pools.ngram.draft_tokens: expected int | mapping | null, got 'four'"),
    ("draft_tokens: 4, pair", "draft_tokens: 0, pair",
     "p.yaml:9:42: pools.ngram.draft_tokens: expected int >= 1, got 0"),
    ("proposer: ngram", "proposer: ngrm",
     "p.yaml:9:21: pools.ngram.proposer: invalid value 'ngrm'; expected one of: none, ngram, suffix, hybrid, "
     "draft_model, eagle, eagle3, standalone"),
    ("then: auto}", "then: autoo}",
     "p.yaml:13:27: rules[2] (Rule 'learned').then: invalid value 'autoo'; expected one of: bypass, auto, "
     "a mapping with pool, pools, draft_tokens"),
    ("  - {name: prose}\n", "",
     "p.yaml:3:3: slices: no default slice; add a last slice without 'when', e.g. {name: prose}"),
    ("  - {name: learned, then: auto}\n", "  - {name: learned, then: auto}\n  - {name: late, then: bypass}\n",
     "p.yaml:14:5: rules[3] (Rule 'late'): unreachable: rule 'late' comes after the catch-all rule 'learned' "
     "(rules[2]); move it up or remove it"),
    ("  - {name: learned, then: auto}\n", "  - {name: tiny, then: auto}\n",
     "p.yaml:13:12: rules[2] (Rule 'tiny').name: duplicate rule name 'tiny' (also rules[0]); rule names must "
     "be unique"),
    ("  ngram: {", "  plain: {",
     "p.yaml:9:3: pools.plain: duplicate key 'plain' (first defined at line 8); remove or rename one"),
    ("when: {slice: code}", "when: {slice: cod}",
     "p.yaml:12:38: rules[1] (Rule 'code-edits').when.slice: unknown slice 'cod'; declared slices: code, prose"),
    ("pair: p,", "pair: q,",
     "p.yaml:9:51: pools.ngram.pair: unknown pair 'q'; declared pairs: p"),
    ("draft: {kind: ngram}", "draft: {kind: layer_truncated, layers: 8}",
     "p.yaml:9:21: pools.ngram.proposer: proposer ngram cannot run pair 'p' (draft kind layer_truncated); "
     "use proposer draft_model or standalone"),
    ("draft_tokens: 4}}", "draft_tokens: 9}}",
     "p.yaml:12:79: rules[1] (Rule 'code-edits').then.draft_tokens: draft_tokens 9 is outside pool 'ngram' "
     "range 4..4; pick a value in range or auto"),
    ("draft_tokens: 4, pair", "draft_tokens: {min: 4, max: 2}, pair",
     "p.yaml:9:42: pools.ngram.draft_tokens: min 4 > max 2; swap them"),
    ("draft_tokens: 4, pair", "draft_tokens: {min: 1, max: 4}, pair",
     "p.yaml:9:10: pools.ngram: a server pool's draft length is fixed when its server starts; give an int "
     "or use speculation: per_request"),
    ("draft_tokens: 4, pair", "draft_tokens: 4, adaptive: true, pair",
     "p.yaml:9:10: pools.ngram: adaptive: true needs speculation: per_request (the embedded worker picks k per "
     "sequence; a server's k is fixed at launch)"),
    ("draft_tokens: 4, pair: p, workers: [\"http://w:1\"]}",
     "draft_tokens: {min: 1, max: 8}, adaptive: true, pair: p, workers: [\"http://w:1\"], speculation: per_request}",
     "p.yaml:9:10: pools.ngram: an adaptive pool's draft_tokens is the largest k the worker may pick (an int, "
     "e.g. 8), not a range"),
    ("draft_tokens: 4, pair: p, workers: [\"http://w:1\"]}",
     "draft_tokens: 4, strategy: sglang, pair: p, workers: [\"http://w:1\"], speculation: per_request}",
     "p.yaml:9:10: pools.ngram: strategy and k_by_batch choose the worker's per-round controller; they need "
     "adaptive: true"),
    ("draft_tokens: 4, pair: p, workers: [\"http://w:1\"]}",
     "draft_tokens: 8, adaptive: true, strategy: vllm, pair: p, workers: [\"http://w:1\"], speculation: per_request}",
     "p.yaml:9:10: pools.ngram: k_by_batch goes with strategy: vllm, and strategy: vllm needs k_by_batch "
     "(e.g. {\"1-3\": 8, \"4-15\": 4, \"16-4096\": 0})"),
    ("draft_tokens: 4, pair: p, workers: [\"http://w:1\"]}",
     "draft_tokens: 8, adaptive: true, strategy: vllm, k_by_batch: {\"1-3\": 8, \"x\": 2}, pair: p, "
     "workers: [\"http://w:1\"], speculation: per_request}",
     "p.yaml:9:10: pools.ngram: k_by_batch: 'x:2' is not LO-HI:K or LO:K (batch sizes >= 1, k >= 0), "
     "e.g. 1-3:8,4-15:4,16-4096:0"),
    ("draft_tokens: 4, pair: p, workers: [\"http://w:1\"]}",
     "draft_tokens: 8, adaptive: true, strategy: eagle, pair: p, workers: [\"http://w:1\"], speculation: per_request}",
     "p.yaml:9:71: pools.ngram.strategy: invalid value 'eagle'; expected one of: beta, sglang, vllm"),
    ("plain: {proposer: none,", "plain: {proposer: none, adaptive: true,",
     "p.yaml:8:10: pools.plain: proposer none takes no adaptive; remove it"),
    ("version: 1", "version: 2", "p.yaml:1:10: version: invalid value 2; expected one of: 1"),
    ("pools:\n", "pools:\n  bad: {proposer: none}\n",
     "p.yaml:8:8: pools.bad: missing required key 'workers'"),
    ("draft: {kind: ngram}", "draft: {kind: ngram, params: {max_match_window: 4}}",
     "p.yaml:6:48: pairs.p.draft: kind ngram has no param 'max_match_window'; allowed: min_match_window_size, "
     "max_match_window_size, match, num_draft_tokens"),
    ("draft: {kind: ngram}", "draft: {kind: ngram, params: {max_match_window_size: 0}}",
     "p.yaml:6:48: pairs.p.draft: param max_match_window_size must be an int >= 1, got 0"),
    ("draft: {kind: ngram}", "draft: {kind: ngram, params: {min_match_window_size: 2.5}}",
     "p.yaml:6:48: pairs.p.draft: param min_match_window_size must be an int >= 1, got 2.5"),
    ("draft: {kind: ngram}", "draft: {kind: ngram, params: {min_match_window_size: 5, max_match_window_size: 4}}",
     "p.yaml:6:48: pairs.p.draft: param min_match_window_size 5 > max_match_window_size 4; swap them"),
    ("draft: {kind: ngram}", "draft: {kind: ngram, params: {match: first}}",
     "p.yaml:6:48: pairs.p.draft: param match must be earliest or latest, got 'first'"),
    ("draft: {kind: ngram}", "draft: {kind: suffix, params: {max_tree_depth: 24, depth: 3}}",
     "p.yaml:6:48: pairs.p.draft: kind suffix has no param 'depth'; allowed: max_tree_depth, max_cached_requests, "
     "max_spec_factor, min_token_prob, max_scopes"),
    ("draft: {kind: ngram}", "draft: {kind: suffix, params: {max_spec_factor: 0}}",
     "p.yaml:6:48: pairs.p.draft: param max_spec_factor must be a number > 0, got 0"),
    ("draft: {kind: ngram}", "draft: {kind: suffix, params: {max_spec_factor: true}}",
     "p.yaml:6:48: pairs.p.draft: param max_spec_factor must be a number > 0, got True"),
    ("draft: {kind: ngram}", "draft: {kind: suffix, params: {min_token_prob: 1.5}}",
     "p.yaml:6:48: pairs.p.draft: param min_token_prob must be a number in [0, 1], got 1.5"),
    ("draft: {kind: ngram}", "draft: {kind: suffix, params: {max_scopes: 0}}",
     "p.yaml:6:48: pairs.p.draft: param max_scopes must be an int >= 1, got 0"),
    ("draft: {kind: ngram}", "draft: {kind: suffix}",
     "p.yaml:9:21: pools.ngram.proposer: proposer ngram cannot run pair 'p' (draft kind suffix); use proposer "
     "suffix or hybrid"),
    ("proposer: ngram, draft_tokens: 4, pair: p, workers: [\"http://w:1\"]}",
     "proposer: hybrid, draft_tokens: 8, adaptive: true, strategy: sglang, pair: p, workers: [\"http://w:1\"], "
     "speculation: per_request}",
     "p.yaml:9:10: pools.ngram: proposer hybrid picks its source and k per round with strategy beta, not sglang; "
     "remove strategy or use another proposer"),
    # the 0..1 scores take only bounds in [0, 1]; a string or a bool is not a number
    ("when: {code_score: {gte: 0.5}}", "when: {prompt_repeat: 1.5}",
     "p.yaml:3:40: slices[0] (Slice 'code').when.prompt_repeat: expected float <= 1.0, got 1.5"),
    ("when: {code_score: {gte: 0.5}}", "when: {prompt_repeat: {gte: 1.5}}",
     "p.yaml:3:46: slices[0] (Slice 'code').when.prompt_repeat.gte: expected float <= 1.0, got 1.5"),
    ("when: {code_score: {gte: 0.5}}", "when: {prompt_repeat: {lt: -0.1}}",
     "p.yaml:3:45: slices[0] (Slice 'code').when.prompt_repeat.lt: expected float >= 0.0, got -0.1"),
    ("when: {code_score: {gte: 0.5}}", "when: {prompt_repeat: high}",
     "p.yaml:3:40: slices[0] (Slice 'code').when.prompt_repeat: expected float | mapping | null, got 'high'"),
    ("when: {code_score: {gte: 0.5}}", "when: {prompt_repeat: {gte: high}}",
     "p.yaml:3:46: slices[0] (Slice 'code').when.prompt_repeat.gte: expected float | null, got 'high'"),
    ("when: {code_score: {gte: 0.5}}", "when: {prompt_repeat: {}}",
     "p.yaml:3:40: slices[0] (Slice 'code').when.prompt_repeat: empty comparison; give at least one of gt, gte, "
     "lt, lte, eq"),
    ("when: {code_score: {gte: 0.5}}", "when: {prompt_repeat: {gte: 0.3, lte: 2}}",
     "p.yaml:3:56: slices[0] (Slice 'code').when.prompt_repeat.lte: expected float <= 1.0, got 2"),
    ("when: {code_score: {gte: 0.5}}", "when: {prompt_repeat: {gte: 0.2}, prompt_repeats: 0.1}",
     "p.yaml:3:52: slices[0] (Slice 'code').when.prompt_repeats: unknown key 'prompt_repeats'; did you mean "
     "'prompt_repeat'?"),
    ("when: {code_score: {gte: 0.5}}", "when: {code_score: {gte: 1.5}}",
     "p.yaml:3:43: slices[0] (Slice 'code').when.code_score.gte: expected float <= 1.0, got 1.5"),
    ("when: {max_tokens: {lt: 8}}", "when: {max_tokens: {lt: 8}, prompt_repeat: true}",
     "p.yaml:11:61: rules[0] (Rule 'tiny').when.prompt_repeat: expected float | mapping | null, got true"),
])
def test_exact_error_messages(old: str, new: str, expected: str) -> None:
    assert old in BASE
    assert errors_of(BASE.replace(old, new, 1)) == [expected]


def test_a_hybrid_pool_runs_an_ngram_or_suffix_pair_only() -> None:
    text = BASE.replace("draft: {kind: ngram}", "draft: {kind: layer_truncated, layers: 8}").replace(
        "proposer: ngram,", "proposer: hybrid,")
    assert errors_of(text) == ["p.yaml:9:21: pools.ngram.proposer: proposer hybrid cannot run pair 'p' (draft kind "
                               "layer_truncated); use proposer draft_model or standalone"]
    assert load_policy(BASE.replace("proposer: ngram,", "proposer: hybrid,"), "p.yaml").pools["ngram"].proposer == (
        "hybrid")


def test_yaml_syntax_error_has_position() -> None:
    assert errors_of("version: 1\nslices: [\n") == ["p.yaml:3:1: (top level): invalid YAML: expected the node "
                                                     "content, but found '<stream end>'"]


def test_out_of_range_learning_value() -> None:
    assert errors_of(BASE + "learning: {repeat_bands: [1.5]}\n") == [
        "p.yaml:14:27: learning.repeat_bands[0]: expected float <= 1.0, got 1.5"]


def test_unreachable_slice_and_unknown_route_are_all_reported() -> None:
    text = BASE.replace("  - {name: prose}\n", "  - {name: prose}\n  - {name: late, when: {route: idee}}\n")
    assert errors_of(text) == [
        "p.yaml:5:32: slices[2] (Slice 'late').when.route: unknown route 'idee'; declared routes: default",
        "p.yaml:5:5: slices[2] (Slice 'late'): unreachable: slice 'late' comes after the default slice 'prose' "
        "(slices[1]); move it up or remove it",
    ]


def test_two_keyless_routes_and_missing_plain_pool() -> None:
    text = BASE.replace("  plain: {proposer: none, workers: [\"http://w:1\"]}\n", "") + \
        "routes:\n  - {name: a}\n  - {name: b}\n"
    assert errors_of(text) == [
        "p.yaml:15:5: routes[1] (Route 'b'): route 'b' has no api keys, like route 'a'; only one default "
        "(key-less) route is allowed: give it api_keys_env or api_keys_file",
        "p.yaml:8:3: pools: no pool with proposer none, and pool(s) ngram cannot switch speculation off per "
        "request; declare a plain pool (bypass and the safety fallback need one)",
    ]


SUFFIX = BASE.replace("draft: {kind: ngram}", "draft: {kind: suffix, params: {max_tree_depth: 24, "
                      "max_cached_requests: 1000, max_spec_factor: 1.0, min_token_prob: 0.1, max_scopes: 64}}"
                      ).replace("proposer: ngram", "proposer: suffix")


def test_suffix_pair_and_pool_load_with_their_params() -> None:
    policy = load_policy(SUFFIX, "p.yaml")
    assert (policy.pools["ngram"].proposer, policy.pairs["p"].draft.kind) == ("suffix", "suffix")
    assert policy.pairs["p"].draft.params == {"max_tree_depth": 24, "max_cached_requests": 1000,
                                              "max_spec_factor": 1.0, "min_token_prob": 0.1, "max_scopes": 64}
    ngram = load_policy(BASE.replace("draft: {kind: ngram}", "draft: {kind: ngram, params: {min_match_window_size: "
                                     "2, max_match_window_size: 2, match: latest, num_draft_tokens: 8}}"), "p.yaml")
    assert ngram.pairs["p"].draft.params == {"min_match_window_size": 2, "max_match_window_size": 2,
                                             "match": "latest", "num_draft_tokens": 8}
    # kinds without a param list keep free-form params (EAGLE's num_steps, eagle_topk)
    eagle = BASE.replace("draft: {kind: ngram}", "draft: {kind: eagle3, model: e, params: {num_steps: 3, x: y}}")
    assert load_policy(eagle.replace("proposer: ngram", "proposer: eagle3"), "p.yaml").pairs["p"].draft.params == {
        "num_steps": 3, "x": "y"}


@pytest.mark.parametrize("old, new", [
    ("max_match_window_size: 12", "max_match_window_size: 4"),
    ("match: earliest", "match: latest"),
    ("match: earliest}", "match: earliest, num_draft_tokens: 8}"),
])
def test_a_change_of_ngram_params_is_a_new_pair_version(old: str, new: str) -> None:
    text = BASE.replace("draft: {kind: ngram}", "draft: {kind: ngram, params: {max_match_window_size: 12, "
                        "match: earliest}}")
    assert old in text
    before, after = load_policy(text, "p.yaml"), load_policy(text.replace(old, new), "p.yaml")
    assert before.pool_pair_version("ngram") != after.pool_pair_version("ngram")
    assert before.pool_pair_version("ngram") == load_policy(text, "p.yaml").pool_pair_version("ngram")


@pytest.mark.parametrize("old, new", [
    ("max_tree_depth: 24", "max_tree_depth: 16"), ("max_cached_requests: 1000", "max_cached_requests: 10"),
    ("max_spec_factor: 1.0", "max_spec_factor: 2.0"), ("min_token_prob: 0.1", "min_token_prob: 0.2"),
    ("max_scopes: 64", "max_scopes: 8"), (", max_scopes: 64}", "}"),
])
def test_a_change_of_suffix_params_is_a_new_pair_version(old: str, new: str) -> None:
    assert old in SUFFIX
    assert load_policy(SUFFIX, "p.yaml").pool_pair_version("ngram") != load_policy(
        SUFFIX.replace(old, new), "p.yaml").pool_pair_version("ngram")
