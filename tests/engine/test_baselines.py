"""SGLang's and vLLM's draft-length controllers as the engine reproduces them (backends/engine/baselines.py),
driven by scripted rounds."""

from __future__ import annotations

import pytest

from backends.engine.baselines import SglangAdaptive, VllmDynamic
from policies.schema import parse_k_by_batch


def test_sglang_follows_its_ema_warmup_interval_and_hysteresis():
    c = SglangAdaptive(k_max=7)
    assert (c.steps, c.current, c.ema) == ([1, 3, 7], 7, 6.0)

    def batch(*accepted: int) -> None:
        for a in accepted:
            c.observe(7, a)
        c.end_step()

    for _ in range(10):  # warm-up: the EMA moves, the step does not
        batch(0, 0)
    assert c.current == 7 and c.ema == pytest.approx(6.0 * 0.8 ** 10)
    for _ in range(4):
        batch(0)
    assert c.current == 7  # not yet an update batch
    batch(0)  # the 5th after warm-up: ema ~0.21 <= 1 - 0.5 - 0.25 -> down to 1 (steps 3 and 1 both pass)
    assert c.current == 1
    for _ in range(5):
        batch(7, 7)  # ema rises past 1 - 0.5 + 0.0 and past 3 - 0.5: up to 7 at the next update
    assert c.ema > 2.5 and c.current == 7
    assert c.choose(batch=40) == 7  # the batch size does not change the step below 64


def test_sglang_adds_the_initial_step_and_never_serves_plain():
    c = SglangAdaptive(k_max=8)
    assert c.steps == [1, 3, 7, 8]
    for _ in range(100):
        c.observe(8, 0)
        c.end_step()
    assert c.current == 1


def test_vllm_table_by_batch_size_with_gaps_and_clamp():
    c = VllmDynamic(k_max=6, table=parse_k_by_batch("1-3:8, 8-15:4, 16-4096:0"))
    assert c.table == ((1, 8), (8, 4), (16, 0))
    assert [c.choose(b) for b in (1, 3, 5, 8, 15, 16, 500)] == [6, 6, 6, 4, 4, 0, 0]
    assert VllmDynamic(k_max=5, table=((4, 2),)).choose(1) == 5  # below the first range: draft_tokens


@pytest.mark.parametrize("text", ["", "1-3", "a:2", "0-3:2", "1-3:x"])
def test_vllm_table_syntax_errors_name_the_field_and_an_example(text):
    with pytest.raises(ValueError, match="k_by_batch"):
        parse_k_by_batch(text)
