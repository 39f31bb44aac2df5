"""A worker's live step costs as a replay cost model (policies/live_costs.py ``from_server_info``): the exact
grids, draft costs and overhead of a scripted ``/server_info``, and every refusal with the field it names."""

from __future__ import annotations

import msgspec
import pytest

from backends.sglang.wire import ServerInfo
from policies.costmodel import CostModelError, DraftCost, Grid
from policies.live_costs import from_server_info
from tests.backends.replay_server import fixture_bytes
from tests.policies.costmodel_helpers import REVISION, URL, report

INSTEAD = ("price replay with a cost model file instead: specgate trace calibrate --out FILE, or one filled from "
           "SGLang's benchmarks (docs/replay.md)")


def test_one_grid_per_sequence_count_at_the_calibration_context():
    cost = from_server_info(report(), URL + "/", created="2026-12-04T17:00:00+00:00")
    assert (cost.model, cost.revision, cost.hardware, cost.source, cost.created) == (
        "SmolLM2-135M-Instruct", REVISION, "float32", f"specgate worker /server_info at {URL}",
        "2026-12-04T17:00:00+00:00")
    assert cost.batch == [1, 4, 16]
    assert cost.forward == [
        Grid(tokens=[1, 2, 5, 33], context=[32], seconds=[[0.020], [0.021], [0.024], [0.060]]),
        Grid(tokens=[1, 5], context=[32], seconds=[[0.030], [0.050]]),  # the mixed step (4, 7) is left out
        Grid(tokens=[1, 5], context=[32], seconds=[[0.080], [0.200]])]
    assert cost.prefill == cost.forward[0]
    assert cost.draft == {"draft_model": DraftCost(token_s=[0.004]), "ngram": DraftCost(token_s=[2e-06])}
    assert cost.overhead_s == 0.0005 and cost.serving_s == 0.0
    # one context: a round costs the same at any context
    assert cost.round_s("ngram", 4, 32) == cost.round_s("ngram", 4, 2000) == 4 * 2e-06 + 0.024 + 0.0005
    assert cost.forward_s(5, 1000, batch=16) == 0.200


def test_a_proposer_that_never_drafted_has_no_draft_cost():
    cost = from_server_info(report(specgate_draft_token_s={"ngram": 2e-06}), URL)
    assert sorted(cost.draft) == ["ngram"]
    with pytest.raises(ValueError, match=r"^the cost model has no draft cost for proposer 'suffix' \(it has: ngram\)"):
        cost.draft_s("suffix", 2, 32)


def test_an_sglang_server_reports_no_table():
    info = msgspec.json.decode(fixture_bytes("server_info.json"), type=ServerInfo)
    with pytest.raises(CostModelError) as caught:
        from_server_info(info, URL)
    assert str(caught.value) == (
        f"{URL}/server_info: field specgate_step_costs: empty or absent (an SGLang server reports none; a specgate "
        f"worker once it calibrated or served); {INSTEAD}")


@pytest.mark.parametrize(("changes", "message"), [
    (dict(specgate_step_costs_context=None),
     "field specgate_step_costs_context: not reported, so the context the table was measured at is unknown (the "
     f"worker started with --no-calibrate); restart it without --no-calibrate, or {INSTEAD}"),
    (dict(specgate_step_costs=[(4, 4, 0.03), (16, 16, 0.08)]),
     f"field specgate_step_costs: no one-sequence rows [1, tokens, seconds] (only sequence counts [4, 16]); {INSTEAD}"),
    (dict(specgate_step_costs=[(1, 1, 0.0)]),
     "field forward[0].seconds[0][0]: 0.0; seconds must be finite and > 0 (remeasure it)"),
    (dict(revision=None), "field revision: empty; give the target weights' revision (specgate model info) so a "
                          "replay can check the model it times"),
], ids=["uncalibrated", "no-one-sequence-rows", "zero-seconds", "no-revision"])
def test_refusals_name_the_field_and_the_fix(changes, message):
    with pytest.raises(CostModelError) as caught:
        from_server_info(report(**changes), URL)
    assert str(caught.value) == f"{URL}/server_info: {message}"


def test_another_revision_than_the_trace_is_refused_as_a_file_is():
    other = "sha256:" + "cd" * 32
    assert from_server_info(report(), URL, revision=REVISION).revision == REVISION
    with pytest.raises(CostModelError) as caught:
        from_server_info(report(), URL, revision=other)
    assert str(caught.value) == (
        f"{URL}/server_info: field revision: the cost model was calibrated for model revision {REVISION}, this "
        f"model is {other}; recalibrate (specgate trace calibrate) on this model")
