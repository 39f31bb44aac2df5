"""A real `specgate worker` that calibrated at start-up (context 32 tokens): its /server_info step costs
written as a replay cost model by `specgate trace calibrate --from-worker`, every number as the worker reports
it (policies/live_costs.py ``from_server_info``), its proposers' draft costs included. One worker, no requests:
start-up is ~15 s on 2 cores."""

from __future__ import annotations

import time

import httpx
import pytest

from backends.engine.startup_costs import CALIBRATION_BATCHES, CALIBRATION_WIDTHS
from backends.engine.step_costs import centered
from bench.processes import worker
from cli import main
from policies.costmodel import load_cost_model

pytestmark = [pytest.mark.integration, pytest.mark.real_model]


@pytest.fixture(scope="module")
def url(tmp_path_factory, prepared_model):
    with worker(tmp_path_factory.mktemp("worker"), "--num-threads", "1", calibrate=True) as base:
        yield base


def _server_info(url: str) -> dict:
    return httpx.get(f"{url}/server_info", timeout=30).json()


def _calibrated_between_equal_reads(url: str, out, capsys) -> tuple[dict, str]:
    """Run ``trace calibrate --from-worker`` between two reads of the worker's /server_info until the step costs
    are the same in both (no forward was recorded meanwhile), and return that report and what the command printed. A start-up readiness probe's
    one-token generation is a forward too: a probe a client gave up on, on a slow machine, may be recorded after the
    probe that answered (two CI runs saw the table change with no request of the test's between)."""
    for _ in range(20):
        before = _server_info(url)
        assert main(["trace", "calibrate", "--from-worker", url, "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        after = _server_info(url)
        if after["specgate_step_costs"] == before["specgate_step_costs"]:
            return after, printed
        time.sleep(0.5)
    raise AssertionError("the worker's step costs kept changing with no request sent: it is stepping on its own")


def test_from_worker_writes_the_workers_live_step_costs(url, prepared_model, tmp_path, capsys):
    out = tmp_path / "costs.json"
    info, printed = _calibrated_between_equal_reads(url, out, capsys)
    assert printed.startswith(f"{out}: cost model of SmolLM2-135M-Instruct "
                              f"({prepared_model.revision}) from specgate worker /server_info at {url}\n")
    cost = load_cost_model(out, revision=prepared_model.revision)
    assert info["specgate_step_costs_context"] == 32
    assert cost.batch == [1, *CALIBRATION_BATCHES]
    assert [grid.tokens for grid in cost.forward] == [list(CALIBRATION_WIDTHS)] + [[1, 5]] * len(CALIBRATION_BATCHES)
    assert all(grid.context == [32] for grid in cost.forward)
    table = {(n, tokens): seconds for n, tokens, seconds in info["specgate_step_costs"]}  # measured, unfitted
    widths = [tokens for n, tokens in sorted(table) if n == 1]
    assert [row[0] for row in cost.forward[0].seconds] == [table[1, w] for w in widths]  # every number as reported
    assert [row[0] for row in cost.forward[0].fitted] == pytest.approx(centered(widths, [table[1, w] for w in widths]),
                                                                   rel=1e-9)  # read as the engine reads its own
    assert [row[0] for row in cost.forward[2].fitted] == pytest.approx(centered([16, 80], [table[16, 16],
                                                                                          table[16, 80]]), rel=1e-9)
    assert cost.prefill == cost.forward[0]
    # no request served, yet every proposer is priced: the start-up calibration timed each one's drafts
    drafts = info["specgate_draft_token_s"]
    assert sorted(drafts) == ["draft_model", "ngram", "suffix"] and all(s > 0 for s in drafts.values())
    assert {name: d.token_s for name, d in cost.draft.items()} == {name: [s] for name, s in drafts.items()}
    assert cost.overhead_s == info["specgate_round_overhead_s"] > 0
    assert cost.source == f"specgate worker /server_info at {url}" and cost.hardware == "float32"
