"""bench/engine.py's accounting: transformers' forwards counted by a hook are its prompt lookup's rounds,
per-prompt comparisons are exact, and the replayed suffix arms keep or drop the earlier outputs as named."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from bench.engine import ForwardCounter, Run, compare, pooled, replayed
from backends.engine.counterfactual import Recorded, replay
from backends.engine.types import SpeculationParams


def _run(prompt: str, tokens: int, forwards: int, slice_: str = "code") -> Run:
    return Run(prompt, slice_, tuple(range(tokens)), forwards, 0.0)


def test_compare_counts_worse_equal_better_per_prompt_exactly():
    ours = [_run("a", 64, 17), _run("b", 64, 16), _run("c", 10, 3), _run("d", 7, 7)]
    theirs = [_run("a", 64, 17), _run("b", 64, 17), _run("c", 20, 6), _run("d", 8, 7)]
    assert compare({"x": ours, "y": theirs}, "x", "y") == {"worse": ["d"], "equal": ["a", "c"], "better": ["b"]}
    assert compare({"x": ours}, "x", "y") is None


def test_pooled_accept_length_sums_tokens_and_forwards():
    assert pooled([_run("a", 64, 16), _run("b", 8, 8)]) == Fraction(72, 24)
    assert pooled([]) is None


def test_suffix_own_tree_replay_does_not_see_earlier_outputs():
    # arctic-inference (the suffix proposer's trees) is part of `make setup`, like the suffix tests of tests/engine
    prompt, output = (1, 2, 3, 4), tuple(range(100, 130))
    records = [Recorded(prompt=prompt, output=(), max_new_tokens=len(output))] * 2
    base = {"engine-plain": [Run(f"p{i}", "code", output, len(output), 0.0) for i in range(2)]}
    out = replayed(base, records, ["engine-suffix-k8 (replay)", "suffix-own-tree-k8 (replay)"])
    shared, own = out["engine-suffix-k8 (replay)"], out["suffix-own-tree-k8 (replay)"]
    assert shared[0].forwards == own[0].forwards == len(output)  # nothing to copy from: one token per forward
    assert shared[1].forwards < len(output)  # the second request copies the first one's output
    assert own[1].forwards == len(output)


@pytest.mark.real_model
@pytest.mark.parametrize("k", [4, 8])
def test_hook_counts_the_rounds_of_transformers_prompt_lookup(real_model, real_tokenizer, k):
    """The forward pre-hook's count on ``generate(prompt_lookup_num_tokens=k)`` equals the rounds of the
    replay of transformers' rule (n-gram n <= 2, earliest match) on the same output: the first call is
    prefill plus the first candidates, every later call one round."""
    model = real_model.runner.model
    code = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
    messages = [{"role": "user", "content": f"Repeat this code exactly:\n\n```python\n{code}```"}]
    ids = real_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = list(ids if isinstance(ids, list) else ids["input_ids"])
    counter = ForwardCounter(model)
    try:
        tensor = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=32,
                                 do_sample=False, prompt_lookup_num_tokens=k,
                                 pad_token_id=real_tokenizer.eos_token_id)
    finally:
        counter.remove()
    new = tuple(out[0, len(ids):].tolist())
    rounds = replay([Recorded(tuple(ids), new, 32)],
                    SpeculationParams(proposer="ngram", draft_tokens=k, ngram_max=2))[0]
    assert counter.calls == rounds.rounds, (counter.calls, rounds)
    assert sum(rounds.accepted) > 0  # the comparison covered rounds that accepted candidates
