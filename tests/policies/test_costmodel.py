"""The replay cost model (policies/costmodel.py): exact interpolation and extrapolation on a hand-made grid,
batch sizes, draft and round costs, and the exact error for every kind of bad file."""

from __future__ import annotations

import json
import os
import stat

import msgspec
import pytest
import yaml

from policies.costmodel import (
    FORMAT, CostModel, CostModelError, DraftCost, Grid, load_cost_model, write_cost_model,
)
from policies.measured import non_decreasing

REVISION = "sha256:" + "ab" * 32
# seconds rise by 0.001 per context token at width 1 and 0.002 at width 9, and by 0.25 per token fed
GRID = Grid(tokens=[1, 9], context=[100, 1100], seconds=[[1.0, 2.0], [3.0, 5.0]])
DRAFT = {"ngram": DraftCost(call_s=0.001, setup_token_s=1e-5),
         "draft_model": DraftCost(call_s=0.002, context=[100, 1100], token_s=[0.01, 0.03], setup_token_s=0.002)}


def model(**changes) -> CostModel:
    fields = dict(format=FORMAT, model="SmolLM2-135M-Instruct", revision=REVISION, forward=[GRID],
                  prefill=Grid(tokens=[16, 256], context=[0, 1024], seconds=[[0.1, 0.2], [1.0, 1.5]]),
                  draft=DRAFT, overhead_s=0.5)
    return CostModel(**{**fields, **changes})


def raw(**changes) -> dict:
    return {**msgspec.to_builtins(model()), **changes}


@pytest.mark.parametrize(("tokens", "context", "seconds"), [
    (1, 100, 1.0), (9, 1100, 5.0), (1, 1100, 2.0), (9, 100, 3.0),  # the measured points
    (5, 600, 2.75), (1, 600, 1.5), (3, 100, 1.5),  # bilinear inside
    (1, 2100, 3.0), (9, 2100, 7.0), (17, 2100, 11.0), (17, 100, 5.0),  # above: the end segment's slope
    (1, 0, 1.0), (9, 0, 3.0), (5, 0, 2.0),  # below the smallest context: the nearest point's value
])
def test_grid_interpolates_and_extrapolates_exactly(tokens, context, seconds):
    assert GRID.at(tokens, context) == pytest.approx(seconds, abs=1e-12)


def test_extrapolation_never_goes_below_the_nearest_point():
    falling = Grid(tokens=[2, 4], context=[100, 1100], seconds=[[2.0, 1.0], [1.5, 1.0]])
    assert falling.fitted == [[1.75, 1.0], [1.75, 1.0]]  # width fell 2 -> 4 at context 100 (noise): fitted flat
    assert falling.at(2, 2100) == 1.0  # the line would reach 0.0
    assert falling.at(2, 0) == pytest.approx(1.825)  # rises away from the grid: extrapolated
    assert falling.at(1, 100) == falling.at(8, 100) == 1.75  # flat in width: the nearest point's value
    single = Grid(tokens=[1], context=[64], seconds=[[0.25]])
    assert single.at(1, 0) == single.at(17, 4096) == 0.25


def test_a_grid_is_read_through_its_fit_at_every_context():
    """The EPYC calibration's batch-1 column at context 256 fell 1 -> 2 and 3 -> 5 tokens. The least-squares fit
    pools each dip into a flat run (14.89 at 1 and 2 tokens, 17.84 at 3 and 5); the centred fit draws the line
    between the runs' centres (1.5 tokens, 14.89; 4 tokens, 17.84), so a wider forward always costs more there."""
    grid = Grid(tokens=[1, 2, 3, 5], context=[32, 256], seconds=[[1.0, 15.31], [2.0, 14.47], [3.0, 18.46],
                                                                [4.0, 17.22]])
    assert non_decreasing([15.31, 14.47, 18.46, 17.22]) == pytest.approx([14.89, 14.89, 17.84, 17.84])
    assert [row[1] for row in grid.fitted] == pytest.approx([14.89, 14.89 + 2.95 / 5, 14.89 + 2.95 * 3 / 5, 17.84])
    assert [row[0] for row in grid.fitted] == [1.0, 2.0, 3.0, 4.0]  # already rising: as measured
    assert grid.at(4, 256) == pytest.approx((16.66 + 17.84) / 2)
    assert grid.seconds[1] == [2.0, 14.47]  # the measurements stay what a file holds


def test_a_grid_written_and_read_again_reads_the_same():
    """A flat first run of three counts (1-3 tokens pooled at 0.049) is where the centred fit of a fit moves: a grid
    that kept its fit as its seconds read 2 tokens at 0.04933 once written and read again (the CI run of 70a16dc:
    0.048469 became 0.048565)."""
    grid = Grid(tokens=[1, 2, 3, 5, 9], context=[32], seconds=[[0.050], [0.048], [0.049], [0.052], [0.060]])
    assert [row[0] for row in grid.fitted] == pytest.approx([0.049, 0.049, 0.050, 0.052, 0.060])
    again = msgspec.json.decode(msgspec.json.encode(grid), type=Grid)
    assert again == grid and again.fitted == grid.fitted
    refit = Grid(tokens=grid.tokens, context=grid.context, seconds=grid.fitted)  # what keeping the fit did
    assert refit.fitted[1][0] == pytest.approx(0.049 + 0.001 / 3)


def test_forward_s_over_batch_sizes():
    double = Grid(tokens=GRID.tokens, context=GRID.context, seconds=[[2.0, 4.0], [6.0, 10.0]])
    two = model(batch=[1, 4], forward=[GRID, double])
    assert two.forward_s(1, 100) == 1.0
    assert two.forward_s(1, 100, batch=2) == pytest.approx(4 / 3)  # linear between batch 1 and 4
    assert two.forward_s(5, 600, batch=4) == 5.5
    assert two.forward_s(1, 100, batch=8) == 4.0  # above the largest: 8 / 4 times batch 4's value
    assert model(batch=[2, 4], forward=[GRID, double]).forward_s(1, 100, batch=1) == 1.0  # the smallest's grid
    assert model().forward_s(9, 1100, batch=3) == 15.0  # batch [1]: three forwards' time
    with pytest.raises(ValueError, match="^batch must be >= 1, got 0$"):
        model().forward_s(1, 100, batch=0)
    with pytest.raises(ValueError, match="^tokens must be >= 1, got 0$"):
        model().forward_s(0, 100)
    assert model().prefill_s(136, 512) == pytest.approx(0.15 + 0.5 * (1.25 - 0.15))


def test_draft_and_round_costs():
    m = model()
    assert m.draft_s("none", 0, 600) == m.draft_s("ngram", 0, 600) == 0.0
    assert m.draft_s("ngram", 4, 600) == 0.001  # model-free: per call, whatever k
    assert m.draft_s("draft_model", 4, 600) == pytest.approx(0.002 + 4 * 0.02)
    assert m.draft_s("draft_model", 4, 5000) == pytest.approx(0.002 + 4 * 0.03)  # clamped at the ends
    assert m.draft_s("draft_model", 1, 0) == pytest.approx(0.012)
    assert m.round_s("none", 0, 600) == pytest.approx(1.5 + 0.5)
    assert m.round_s("draft_model", 4, 600) == pytest.approx(0.082 + 2.75 + 0.5)
    assert m.round_s("ngram", 8, 1100) == pytest.approx(0.001 + 5.0 + 0.5)
    with pytest.raises(ValueError) as missing:
        m.draft_s("suffix", 4, 600)
    assert str(missing.value) == ("the cost model has no draft cost for proposer 'suffix' (it has: draft_model, "
                                  "ngram); recalibrate with that proposer (specgate trace calibrate) or add "
                                  "draft.suffix")
    with pytest.raises(ValueError, match="^proposer none is a plain step: k must be 0, got 2$"):
        m.round_s("none", 2, 600)
    assert m.setup_s("none", 1000) == 0.0
    assert m.setup_s("ngram", 1000) == pytest.approx(0.01) and m.setup_s("draft_model", 1000) == 2.0
    with pytest.raises(ValueError, match="^the cost model has no draft cost for proposer 'suffix'"):
        m.setup_s("suffix", 1000)


def test_hybrid_costs_both_sources_calls_unless_measured_itself():
    both = model(draft={**DRAFT, "suffix": DraftCost(call_s=0.003, setup_token_s=1e-6)})
    assert both.draft_s("hybrid", 4, 600) == pytest.approx(0.001 + 0.003)  # n-gram's call and suffix's
    assert both.setup_s("hybrid", 1000) == pytest.approx(both.setup_s("ngram", 1000) + 0.001)
    own = model(draft={**DRAFT, "suffix": DraftCost(call_s=0.003), "hybrid": DraftCost(call_s=0.0042)})
    assert own.draft_s("hybrid", 4, 600) == 0.0042
    # per-token costs (a worker's live step costs report them for n-gram and suffix) add at every context
    live = model(draft={"ngram": DraftCost(token_s=[2e-6]), "suffix": DraftCost(token_s=[4e-6])})
    assert live.draft_s("hybrid", 4, 600) == pytest.approx(4 * 6e-6)
    grown = model(draft={"ngram": DraftCost(call_s=0.001, token_s=[2e-6]),
                         "suffix": DraftCost(context=[100, 1100], token_s=[1e-5, 3e-5])})
    assert [grown.draft_s("hybrid", 2, c) for c in (0, 600, 2000)] == pytest.approx(
        [0.001 + 2 * 1.2e-5, 0.001 + 2 * 2.2e-5, 0.001 + 2 * 3.2e-5])
    with pytest.raises(ValueError, match="^the cost model has no draft cost for proposer 'hybrid'"):
        model().draft_s("hybrid", 4, 600)  # no suffix cost to add


def test_a_written_model_reads_back_equal_and_editable(tmp_path):
    path = tmp_path / "cost.json"
    write_cost_model(path, model(hardware="2-core Xeon", source="test", created="2025-01-01T00:00:00+00:00"))
    assert load_cost_model(path, revision=REVISION) == model(hardware="2-core Xeon", source="test",
                                                             created="2025-01-01T00:00:00+00:00")
    text = path.read_text()
    assert '"seconds": [\n        [1.0, 2.0],\n        [3.0, 5.0]\n      ]' in text  # a grid row per line
    assert json.loads(text)["format"] == 1
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["cost.json"]


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_yaml_reads_like_json(tmp_path, suffix):
    path = tmp_path / f"cost{suffix}"
    path.write_text(yaml.safe_dump(msgspec.to_builtins(model())))
    assert load_cost_model(path) == model()
    path.write_text(yaml.safe_dump(raw(overhead="x")))
    with pytest.raises(CostModelError) as bad:
        load_cost_model(path)
    assert str(bad.value) == f"{path}: field overhead: unknown field (cost model format 1)"


def grid(**changes) -> dict:
    return {**msgspec.to_builtins(GRID), **changes}


@pytest.mark.parametrize(("data", "message"), [
    (raw(speed=1), "field speed: unknown field (cost model format 1)"),
    (raw(forward=[grid(extra=1)]), "field forward[0].extra: unknown field (cost model format 1)"),
    ({k: v for k, v in raw().items() if k != "prefill"}, "field prefill: missing (a required field)"),
    (raw(format=2), "field format: invalid enum value 2; this specgate reads cost model format 1"),
    (raw(revision=""), "field revision: empty; give the target weights' revision (specgate model info) so a "
                       "replay can check the model it times"),
    (raw(forward=[grid(seconds=[[1.0, 2.0], ["x", 5.0]])]),
     "field forward[0].seconds[1][0]: expected `float`, got `str`"),
    (raw(forward=[grid(seconds=[[1.0, 2.0]])]),
     "field forward[0].seconds: 1 rows for 2 tokens; give one row per entry of tokens"),
    (raw(forward=[grid(seconds=[[1.0, 2.0], [3.0]])]),
     "field forward[0].seconds[1]: 1 values for 2 contexts; give one value per entry of context"),
    (raw(forward=[grid(seconds=[[1.0, 0.0], [3.0, 5.0]])]),
     "field forward[0].seconds[0][1]: 0.0; seconds must be finite and > 0 (remeasure it)"),
    (raw(forward=[grid(seconds=[[1.0, 2.0], [-3.0, 5.0]])]),
     "field forward[0].seconds[1][0]: -3.0; seconds must be finite and > 0 (remeasure it)"),
    (raw(forward=[grid(tokens=[0, 9])]), "field forward[0].tokens[0]: 0; tokens fed per sequence must be >= 1"),
    (raw(forward=[grid(tokens=[9, 1])]),
     "field forward[0].tokens[1]: 1 after 9; list tokens fed per sequence in ascending order, each once"),
    (raw(forward=[grid(tokens=[])]), "field forward[0].tokens: empty; give at least one tokens fed per sequence"),
    (raw(prefill=grid(context=[100, 100])),
     "field prefill.context[1]: 100 after 100; list context lengths in ascending order, each once"),
    (raw(prefill=grid(context=[-1, 100])), "field prefill.context[0]: -1; context lengths must be >= 0"),
    (raw(batch=[1, 4]), "field forward: 1 grids for 2 batch sizes [1, 4]; give one grid per entry of batch"),
    (raw(batch=[4, 1], forward=[grid(), grid()]),
     "field batch[1]: 1 after 4; list batch sizes in ascending order, each once"),
    (raw(draft={"ngram": {"call_s": 0.001, "per_token": 1}}),
     "field draft.ngram.per_token: unknown field (cost model format 1)"),
    (raw(draft={"ngram": {"call_s": -1.0}}),
     "field draft.ngram.call_s: -1.0; seconds must be finite and >= 0 (remeasure it)"),
    (raw(draft={"ngram": {"call_s": "fast"}}), "field draft.ngram.call_s: expected `float`, got `str`"),
    (raw(draft={"ngram": {"setup_token_s": -1e-6}}),
     "field draft.ngram.setup_token_s: -1e-06; seconds must be finite and >= 0 (remeasure it)"),
    (raw(draft={"draft_model": {"context": [0, 100], "token_s": [0.01]}}),
     "field draft.draft_model.token_s: 1 values for 2 contexts; give one value per entry of context"),
    (raw(draft={"draft_model": {"token_s": [0.01, 0.02]}}),
     "field draft.draft_model.token_s: 2 values without context; give one value, or the contexts they were "
     "measured at"),
    (raw(draft={"ngram": 3}), "field draft.ngram: expected `object`, got `int`"),
    (raw(draft={"none": {"call_s": 0.0}}), "field draft.none: proposer none drafts nothing; remove the entry"),
])
def test_every_bad_field_is_named_with_its_fix(tmp_path, data, message):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CostModelError) as bad:
        load_cost_model(path)
    assert str(bad.value) == f"{path}: {message}"


def test_bad_files(tmp_path):
    path = tmp_path / "cost.json"
    write_cost_model(path, model())
    with pytest.raises(CostModelError) as other:
        load_cost_model(path, revision="sha256:" + "cd" * 32)
    assert str(other.value) == (f"{path}: field revision: the cost model was calibrated for model revision "
                                f"{REVISION}, this model is sha256:{'cd' * 32}; recalibrate (specgate trace "
                                "calibrate) on this model")
    path.write_text('{"format": 1,')
    with pytest.raises(CostModelError, match=r"cost\.json: malformed JSON \("):
        load_cost_model(path)
    with pytest.raises(CostModelError) as suffix:
        load_cost_model(tmp_path / "cost.txt")
    assert str(suffix.value) == f"{tmp_path / 'cost.txt'}: unknown suffix '.txt'; name the file .json, .yaml or .yml"
    with pytest.raises(CostModelError) as absent:
        load_cost_model(tmp_path / "absent.json")
    assert str(absent.value) == (f"{tmp_path / 'absent.json'}: cannot read (No such file or directory); write one "
                                 "with specgate trace calibrate")


def test_construction_in_python_checks_too():
    with pytest.raises(ValueError, match=r"^field seconds\[0\]\[0\]: 0.0; seconds must be finite and > 0"):
        Grid(tokens=[1], context=[0], seconds=[[0.0]])
    with pytest.raises(ValueError, match="^field token_s: 2 values for 1 contexts"):
        DraftCost(context=[0], token_s=[0.1, 0.2])
    with pytest.raises(ValueError, match=r"^field overhead_s: nan; seconds must be finite and >= 0 \(remeasure it\)$"):
        model(overhead_s=float("nan"))
    with pytest.raises(ValueError, match=r"^field serving_s: -0.01; seconds must be finite and >= 0 \(remeasure it\)$"):
        model(serving_s=-0.01)
    with pytest.raises(ValueError, match=r"^field serving_concurrent_s: -0.01; seconds must be finite and >= 0"):
        model(serving_concurrent_s=-0.01)
    assert model().serving_concurrent_s is None and model(serving_concurrent_s=0.012).serving_concurrent_s == 0.012
    with pytest.raises(ValueError, match=r"^field serving_streams\[0\]: 1; stream counts must be >= 2"):
        model(serving_streams=[1], serving_streams_s=[0.01])
    with pytest.raises(ValueError, match=r"^field serving_streams\[1\]: 2 after 4; list stream counts in ascending"):
        model(serving_streams=[4, 2], serving_streams_s=[0.01, 0.02])
    with pytest.raises(ValueError, match=r"^field serving_streams_s: 1 values for 2 stream counts \[2, 4\]; give one"):
        model(serving_streams=[2, 4], serving_streams_s=[0.01])
    with pytest.raises(ValueError, match=r"^field serving_streams: empty; give at least one stream count"):
        model(serving_streams_s=[0.01])
    with pytest.raises(ValueError, match=r"^field serving_streams_s\[1\]: -0.02; seconds must be finite and >= 0"):
        model(serving_streams=[2, 4], serving_streams_s=[0.01, -0.02])


def test_the_serving_cost_per_round_follows_the_stream_count():
    flat = model(serving_s=0.015)
    assert [flat.serving_round_s(n) for n in (0, 1, 2, 16)] == [0.015] * 4
    constant = model(serving_s=0.015, serving_concurrent_s=0.01)
    assert [constant.serving_round_s(n) for n in (1, 2, 16)] == [0.015, 0.01, 0.01]
    # a table wins over serving_concurrent_s: linear between its counts, the nearest count's value outside them
    table = model(serving_s=0.015, serving_concurrent_s=0.01, serving_streams=[2, 4, 16],
                  serving_streams_s=[0.01, 0.004, 0.0004])
    assert table.serving_round_s(1) == 0.015
    assert table.serving_round_s(2) == pytest.approx(0.01)
    assert table.serving_round_s(3) == pytest.approx(0.007)
    assert table.serving_round_s(10) == pytest.approx(0.0022)
    assert table.serving_round_s(16) == table.serving_round_s(64) == pytest.approx(0.0004)
    assert model(serving_s=0.015, serving_streams=[4], serving_streams_s=[0.003]).serving_round_s(2) == 0.003
