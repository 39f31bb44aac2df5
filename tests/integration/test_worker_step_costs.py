"""A real `specgate worker` that calibrated at start-up (context 32 tokens): its /server_info step costs
written as a replay cost model by `specgate trace calibrate --from-worker`, every number as the worker reports
it (policies/live_costs.py ``from_server_info``), its proposers' draft costs included. One worker, no requests:
start-up is ~15 s on 2 cores."""

from __future__ import annotations

import time

import httpx
import pytest

from backends.engine.startup_costs import CALIBRATION_BATCHES, CALIBRATION_WIDTHS
from bench.processes import worker
from cli import main
from policies.costmodel import load_cost_model

pytestmark = [pytest.mark.integration, pytest.mark.real_model]


@pytest.fixture(scope="module")
def url(tmp_path_factory, prepared_model):
    with worker(tmp_path_factory.mktemp("worker"), "--num-threads", "1", calibrate=True) as base:
        _settled(base)
        yield base


def _settled(url: str) -> None:
    """Until two reads of the step costs 0.5 s apart agree. The readiness probes' one-token generations are
    forwards too, and one a client gave up on (a probe past its timeout on a slow machine) may be recorded after the
    probe that answered: the CI run of d0f4caf saw the table change between two reads with no request between.
    A deadline only a worker that never stops stepping reaches."""
    last, deadline = None, time.monotonic() + 60
    while time.monotonic() < deadline:
        table = httpx.get(f"{url}/server_info", timeout=30).json()["specgate_step_costs"]
        if table == last:
            return
        last = table
        time.sleep(0.5)


def test_from_worker_writes_the_workers_live_step_costs(url, prepared_model, tmp_path, capsys):
    out = tmp_path / "costs.json"
    assert main(["trace", "calibrate", "--from-worker", url, "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"{out}: cost model of SmolLM2-135M-Instruct "
                                              f"({prepared_model.revision}) from specgate worker /server_info at {url}\n")
    info = httpx.get(f"{url}/server_info", timeout=30).json()  # no request since: the same table
    cost = load_cost_model(out, revision=prepared_model.revision)
    assert info["specgate_step_costs_context"] == 32
    assert cost.batch == [1, *CALIBRATION_BATCHES]
    assert [grid.tokens for grid in cost.forward] == [list(CALIBRATION_WIDTHS)] + [[1, 5]] * len(CALIBRATION_BATCHES)
    assert all(grid.context == [32] for grid in cost.forward)
    table = {(n, tokens): seconds for n, tokens, seconds in info["specgate_step_costs"]}
    assert [[seconds] for (n, _), seconds in sorted(table.items()) if n == 1] == cost.forward[0].seconds
    assert cost.forward[2].seconds == [[table[16, 16]], [table[16, 80]]]
    assert cost.prefill == cost.forward[0]
    # no request served, yet every proposer is priced: the start-up calibration timed each one's drafts
    drafts = info["specgate_draft_token_s"]
    assert sorted(drafts) == ["draft_model", "ngram", "suffix"] and all(s > 0 for s in drafts.values())
    assert {name: d.token_s for name, d in cost.draft.items()} == {name: [s] for name, s in drafts.items()}
    assert cost.overhead_s == info["specgate_round_overhead_s"] > 0
    assert cost.source == f"specgate worker /server_info at {url}" and cost.hardware == "float32"
