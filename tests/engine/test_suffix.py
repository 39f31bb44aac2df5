"""The suffix proposer: drafts are continuations of text its scope has seen, never another scope's; the
trees are bounded; across requests it drafts a repeated answer from the scope's earlier outputs."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.engine.proposers.suffix import SuffixStore
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams, SuffixSettings
from tests.engine.engine_helpers import make_tiny_engine, run_all

GREEDY = SamplingParams(temperature=0.0)
GEN = torch.Generator()


def occurs(needle: list[int], texts: list[list[int]]) -> bool:
    n = len(needle)
    return any(text[i:i + n] == needle for text in texts for i in range(len(text) - n + 1))


def serve(store: SuffixStore, scope: str, prompt: list[int], output: list[int], k: int,
          seen: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """Commit ``output`` one token per round through a proposer of ``scope``; return (context, draft) pairs.
    ``seen`` is the scope's earlier outputs (brute-force reference of its global tree)."""
    proposer = store.open(scope, prompt)
    drafts = []
    for i in range(len(output) + 1):
        context = prompt + output[:i]
        drafts.append((context, proposer.propose(context, k, GREEDY, None, GEN).tokens))
        if i < len(output):
            proposer.observe(0, 0, prompt + output[:i + 1])
    proposer.release()
    seen.append(output)
    return drafts


texts = st.lists(st.integers(0, 5), min_size=1, max_size=24)


@settings(max_examples=150, deadline=None)
@given(requests=st.lists(st.tuples(st.sampled_from(["a", "b"]), texts, texts), min_size=1, max_size=6),
       k=st.integers(1, 8))
def test_every_draft_continues_text_of_its_own_scope(requests, k):
    """Brute-force reference: a draft d after context c is a path of a suffix tree, so c[-1:] + d occurs in
    this request's prompt + output so far, or in an earlier output of the SAME scope; never only elsewhere."""
    store = SuffixStore(SuffixSettings(max_tree_depth=8, max_cached_requests=100))
    seen: dict[str, list[list[int]]] = {"a": [], "b": []}
    for scope, prompt, output in requests:
        own = list(seen[scope])
        for context, draft in serve(store, scope, prompt, output, k, seen[scope]):
            assert len(draft) <= k
            if draft:
                assert occurs(context[-1:] + draft, [context, *own]), (scope, context, draft, own)


def test_a_route_never_drafts_another_routes_text():
    """Scope ``a`` has answered with a text (tokens 50..59) that scope ``b`` never saw. Asked the same
    question, ``a`` drafts that answer from its global tree (once its first token is committed: the tree
    holds responses, not prompts; at most as many tokens as it has matched, ``max_spec_factor`` 1);
    ``b`` drafts none of it."""
    store = SuffixStore(SuffixSettings(max_tree_depth=8))
    question, answer = [1, 2, 3, 4], list(range(50, 60))
    serve(store, "a", question, answer, 8, [])
    drafts_a = serve(store, "a", question, answer, 8, [])
    drafts_b = serve(store, "b", question, answer, 8, [])
    for i, (_, draft) in enumerate(drafts_a[1:-1], start=1):
        assert 1 <= len(draft) <= min(i, 8) and draft == answer[i:i + len(draft)], (i, draft)
    assert [len(d) for _, d in drafts_a[1:5]] == [1, 2, 3, 4]  # longer match, longer draft
    for context, draft in drafts_b:  # b's drafts may only come from b's own prompt and output so far
        assert occurs(context[-1:] + draft, [context]) if draft else True
    assert all(d == [] for _, d in drafts_b[:-1]), drafts_b  # nothing b has seen continues its context


def test_trees_are_bounded_and_scopes_evicted_least_recently_used():
    store = SuffixStore(SuffixSettings(max_cached_requests=2, max_scopes=2))
    for n in range(3):
        serve(store, "a", [1, 2], [3 + n, 4], 2, [])
    assert store.cached_requests("a") == 2  # FIFO: the first response left the global tree
    running = store.open("b", [9])  # b stays while a request drafts from it
    serve(store, "c", [1], [2], 2, [])
    serve(store, "d", [1], [2], 2, [])
    assert store.scopes == ["b", "d"]  # a and c evicted (least recently used and idle), b in use
    running.release()
    running.release()  # idempotent
    serve(store, "e", [1], [2], 2, [])
    assert store.scopes == ["d", "e"]


def test_engine_drafts_a_repeated_answer_from_the_scope_and_stays_exact(real_tokenizer):
    """The same greedy request three times: in its own scope the repeat drafts from the first answer and
    accepts more; in a fresh scope it does not; every output equals plain decoding."""
    engine = make_tiny_engine(real_tokenizer, seed=3)
    prompt = tuple(real_tokenizer.encode("The quick brown fox jumps over the lazy dog."))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)

    def request(rid: str, spec: SpeculationParams) -> GenerateRequest:
        return GenerateRequest(rid=rid, input_ids=prompt, sampling=sampling, speculation=spec)

    plain = run_all(engine, [request("plain", SpeculationParams())])["plain"][-1]
    outs = {}
    for rid, scope in (("first", "app-a"), ("repeat", "app-a"), ("other", "app-b")):
        outs[rid] = run_all(engine, [request(rid, SpeculationParams(proposer="suffix", draft_tokens=8,
                                                                    scope=scope))])[rid][-1]
        assert outs[rid].output_ids == plain.output_ids, rid
    accepted = {rid: out.stats.num_correct_drafts for rid, out in outs.items()}
    # the repeat's rounds draft 0, 1, 3, 7, 8 tokens (a draft is at most as long as the match, and the match
    # grows with every committed token) and accept all: 24 tokens in 5 rounds. The random tiny model's first
    # answer never repeats itself, so without the scope's earlier answer nothing is accepted.
    assert accepted == {"first": 0, "repeat": 1 + 3 + 7 + 8, "other": 0}
    assert outs["repeat"].stats.verify_ct == 5
    assert engine.suffix_store.scopes == ["app-a", "app-b"]
    assert engine.suffix_store.cached_requests("app-a") == 2


def test_once_an_engine_drafts_from_trees_every_answer_of_a_scope_joins_them(real_tokenizer):
    """A request served plain (or by n-gram) after the suffix trees exist still adds its answer to its scope's
    tree, so the gateway's auto can serve a scope from several pools of one worker without starving suffix of
    the scope's text; before any suffix request nothing is built."""
    engine = make_tiny_engine(real_tokenizer, seed=3)
    prompt = tuple(real_tokenizer.encode("The quick brown fox jumps over the lazy dog."))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)

    def request(rid: str, spec: SpeculationParams) -> GenerateRequest:
        return GenerateRequest(rid=rid, input_ids=prompt, sampling=sampling, speculation=spec)

    run_all(engine, [request("before", SpeculationParams(scope="app-a"))])
    assert engine.slot_maker._suffix_store is None  # no tree is built for a worker that never drafts from one
    other = "Once upon a time there was a small village by the sea."
    run_all(engine, [GenerateRequest(rid="opens", input_ids=tuple(real_tokenizer.encode(other)), sampling=sampling,
                                     speculation=SpeculationParams(proposer="suffix", draft_tokens=8, scope="app-a"))])
    run_all(engine, [request("plain", SpeculationParams(scope="app-a"))])
    run_all(engine, [request("ngram", SpeculationParams(proposer="ngram", draft_tokens=4, scope="app-a"))])
    assert engine.suffix_store.cached_requests("app-a") == 3  # the suffix answer, then the plain and n-gram ones
    repeat = run_all(engine, [request("repeat", SpeculationParams(proposer="suffix", draft_tokens=8,
                                                                  scope="app-a"))])["repeat"][-1]
    assert repeat.stats.num_correct_drafts == 1 + 3 + 7 + 8  # drafted from the plain answer's copy in the tree
