"""bench.prefill_budget's reference rules on the tiny engine (chunks of 16, 512 tokens a step): ``per-prompt``
is the engine's earlier rule (a chunk per prompt, admission order), the shared budgets feed 16 a step
in all; each feeds the three prompts of tests/engine/test_batching.py's shortest-first test in its own order,
and the outputs are the engine's own. Its flags are checked."""

from __future__ import annotations

import pytest

from bench.prefill_budget import AdmissionOrder, FirstComeShared, SharedBudget, main
from tests.engine.engine_helpers import make_tiny_engine, run_all
from tests.engine.batching_helpers import feed_three_prompts


@pytest.mark.parametrize("engine_class, want", [
    (AdmissionOrder, [[("a", 16), ("b", 16), ("c", 9)], [("a", 16), ("b", 16)], [("a", 16), ("b", 16)],
                      [("a", 11), ("b", 1)], []]),
    (SharedBudget, [[("c", 9), ("b", 7)], [("b", 16)], [("b", 16)], [("b", 10), ("a", 6)], [("a", 16)],
                    [("a", 16)], [("a", 16)], [("a", 5)], []]),
    (FirstComeShared, [[("a", 16)], [("a", 16)], [("a", 16)], [("a", 11), ("b", 5)], [("b", 16)], [("b", 16)],
                       [("b", 12), ("c", 4)], [("c", 5)], []]),
])
def test_each_reference_rule_feeds_the_prompts_in_its_order(real_tokenizer, engine_class, want):
    engine = make_tiny_engine(real_tokenizer, engine_class=engine_class, prefill_chunk=16, max_batch_tokens=512)
    requests, events, chunks, _ = feed_three_prompts(engine)
    assert chunks[:len(want)] == want
    same = run_all(make_tiny_engine(real_tokenizer, prefill_chunk=16), requests)  # the engine's own rule
    for request in requests:
        assert events[request.rid][-1].output_ids == same[request.rid][-1].output_ids, request.rid


@pytest.mark.parametrize("argv, message", [
    (["--loads", "p0.5"], "--loads 'p0.5': closed-loop loads only"),
    (["--repeats", "0"], "must be at least 1"),
    (["--requests", "-1"], "--requests at least 0"),
    (["--rules", "lifo"], "invalid choice: 'lifo'"),
])
def test_bad_flags_are_refused_before_any_model_is_loaded(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
