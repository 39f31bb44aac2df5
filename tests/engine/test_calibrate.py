"""`specgate trace calibrate` (backends/engine/calibrate.py) on the tiny random engine: a complete, valid cost
model whose axes are the ones asked for, written and read back equal; rounds recovered one for one from a
real request; the self-check; and the command line's argument errors (no model run)."""

from __future__ import annotations

import pytest

from backends.engine import calibrate as measure
from backends.engine.calibrate import default_text, run_rounds, self_check
from backends.engine.startup_costs import CALIBRATION_BATCHES, CALIBRATION_WIDTHS, measure_steps
from backends.engine.step_costs import StepCosts
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from cli import build_parser, main
from policies.costmodel import from_measurements, load_cost_model, write_cost_model

REVISION = "sha256:" + "00" * 32


def calibrate(*args, **kwargs):
    """The engine measures plain data (it takes no policy types); policies.costmodel types and checks it."""
    return from_measurements(measure.calibrate(*args, **kwargs))


@pytest.fixture(scope="module")
def text_ids(real_tokenizer):
    return real_tokenizer.encode(default_text(), add_special_tokens=False)


def test_calibrate_measures_every_part_of_the_model(tiny_engine, text_ids, tmp_path):
    lines: list[str] = []
    cost = calibrate(tiny_engine, text_ids, model="tiny", revision=REVISION, contexts=(64, 8), widths=(1, 5, 3),
                     prefill_tokens=(16, 4), repeats=1, draft_layers=1, hardware="test", batches=(3,),
                     progress=lines.append)
    assert (cost.model, cost.revision, cost.hardware, cost.source) == ("tiny", REVISION, "test",
                                                                        "specgate trace calibrate")
    assert cost.batch == [1, 3] and len(cost.forward) == 2  # batch 1 is always measured
    for forward in cost.forward:
        assert (forward.tokens, forward.context) == ([1, 3, 5], [8, 64])
    assert (cost.prefill.tokens, cost.prefill.context) == ([4, 16], [0, 8, 64])
    seconds = [s for grid in (*cost.forward, cost.prefill) for row in grid.seconds for s in row]
    assert len(seconds) == 6 + 6 + 6 and all(0 < s < 10 for s in seconds)
    assert set(cost.draft) == {"ngram", "suffix", "draft_model"}
    assert cost.draft["ngram"].call_s > 0 and cost.draft["suffix"].call_s > 0
    assert cost.draft["ngram"].token_s == [] and cost.draft["suffix"].token_s == []
    draft = cost.draft["draft_model"]
    assert draft.context == [8, 64] and all(s > 0 for s in draft.token_s) and draft.call_s >= 0
    assert cost.draft["ngram"].setup_token_s > 0 and cost.draft["suffix"].setup_token_s > 0  # index the prompt
    assert draft.setup_token_s >= 0  # its prefill: on the tiny model barely more than a step
    assert cost.overhead_s > 0
    assert cost.round_s("draft_model", 4, 30) > cost.round_s("none", 0, 30) > 0
    # forwards at 0, 8, 64; of 3 sequences at 8, 64; ngram; suffix; draft at 8, 64, first; overhead
    assert len(lines) == 3 + 2 + 2 + 3 + 1
    assert lines[3].startswith("forwards of 3 sequences at context 8: 1 ")
    path = tmp_path / "cost.json"
    write_cost_model(path, cost)
    assert load_cost_model(path, revision=REVISION) == cost


def test_calibrate_refuses_what_it_cannot_measure(tiny_engine, text_ids):
    with pytest.raises(ValueError, match=r"^context 500 plus 17 tokens exceeds the model's context window \(512\)"):
        calibrate(tiny_engine, text_ids, model="tiny", revision=REVISION, contexts=(500,), widths=(1, 17),
                  prefill_tokens=(4,), repeats=1)
    with pytest.raises(ValueError, match=r"^proposers: unknown \['eagle'\]"):
        calibrate(tiny_engine, text_ids, model="tiny", revision=REVISION, proposers=("eagle",))
    with pytest.raises(ValueError, match="^no token ids to calibrate with"):
        calibrate(tiny_engine, [], model="tiny", revision=REVISION, contexts=(8,), widths=(1,),
                  prefill_tokens=(4,), repeats=1)


def test_rounds_are_recovered_one_for_one(tiny_engine, text_ids):
    prompt = tuple(text_ids[:40])
    plain = run_rounds(tiny_engine, GenerateRequest(
        rid="plain", input_ids=prompt, sampling=SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)))
    assert [(r.context, r.k) for r in plain] == [(39 + i, 0) for i in range(6)]
    assert plain[0].wall_s is None and all(r.wall_s > 0 and r.verify_s > 0 for r in plain[1:])
    ngram = run_rounds(tiny_engine, GenerateRequest(
        rid="ngram", input_ids=prompt * 2, speculation=SpeculationParams(proposer="ngram", draft_tokens=4),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)))
    assert ngram[0].context == 79 and ngram[0].k == 4  # the prompt repeats itself: a full draft at once
    assert all(0 <= r.k <= 4 for r in ngram) and all(b.context > a.context for a, b in zip(ngram, ngram[1:]))


def test_self_check_sets_real_rounds_beside_the_model(tiny_engine, text_ids):
    cost = calibrate(tiny_engine, text_ids, model="tiny", revision=REVISION, contexts=(8, 64), widths=(1, 5),
                     prefill_tokens=(4,), repeats=1, proposers=("ngram",), batches=())
    arms = self_check(tiny_engine, cost.round_s, {name: d.call_s for name, d in cost.draft.items()}, text_ids,
                      prompt_tokens=48, max_new_tokens=8)
    assert [(a.arm, a.rounds) for a in arms] == [("plain", 21), ("ngram-k4", 21)]  # 3 requests x 7 rounds each
    assert all(a.predicted_s > 0 and a.measured_s > 0 and a.ratio > 0 and a.wall_ratio > 0 for a in arms)


def test_the_command_line_checks_its_arguments_before_loading_a_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as usage:
        build_parser().parse_args(["trace", "calibrate", "--contexts", "32"])
    assert usage.value.code == 2
    assert "the following arguments are required: --out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["trace", "calibrate", "--help"])
    shown = capsys.readouterr().out
    assert all(flag in shown for flag in ("--out", "--model-dir", "--num-threads", "--repeats", "--contexts",
                                          "--widths", "--prefill-tokens", "--proposers", "--draft-layers", "--text",
                                          "--batches", "--from-worker"))
    code = main(["trace", "calibrate", "--out", str(tmp_path / "cost.json"), "--repeats", "0"])
    err = capsys.readouterr().err
    assert code == 2 and ("--repeats, --widths, --prefill-tokens and --batches must be at least 1" in err
                          or "no prepared model" in err)
    assert not (tmp_path / "cost.json").exists()


def test_the_start_up_calibration_times_every_shape_and_records_its_context(tiny_engine):
    costs = StepCosts()
    measure_steps(tiny_engine.runner, costs, context=8)
    # keyed by (sequences, tokens in the step): n sequences of w tokens each feed n * w
    assert sorted(costs.forward_s) == sorted([(1, w) for w in CALIBRATION_WIDTHS]
                                             + [(n, n * w) for n in CALIBRATION_BATCHES for w in (1, 5)])
    assert costs.context == 8 and StepCosts().context is None  # what /server_info reports beside the table


def test_the_start_up_calibration_prices_every_proposer_and_a_rounds_overhead(real_tokenizer):
    """A worker that has served nothing reports a draft cost per proposer and an overhead (what replay needs to
    price speculative rounds from /server_info), measured without touching what serving keeps."""
    from backends.engine.startup_costs import measure_rounds
    from tests.engine.engine_helpers import make_tiny_engine

    tiny_engine = make_tiny_engine(real_tokenizer, frozen_costs=False)  # a worker's engine: it measures
    costs = tiny_engine.costs
    assert costs.draft_token_s == {} and costs.overhead_s == 0.0  # the tiny engine does not calibrate
    measure_rounds(tiny_engine, context=8)
    assert sorted(costs.draft_token_s) == ["draft_model", "ngram", "suffix"]
    assert all(seconds > 0 for seconds in costs.draft_token_s.values())
    assert costs.draft_token_s["draft_model"] > costs.draft_token_s["ngram"]  # a forward per token vs a lookup
    assert costs.overhead_s > 0 and costs.forward_s == {}  # its plain rounds' overhead; their forwards not kept
    # nothing a request could see: no suffix scope, no pooled acceptance, no sequence, no KV held
    assert tiny_engine.slot_maker._suffix_store is None or tiny_engine.suffix_store.scopes == []
    assert tiny_engine.slot_maker.shared_controllers == {} and tiny_engine._slots == {}
    assert tiny_engine.scheduler.running == [] and tiny_engine.scheduler.reserved == 0
