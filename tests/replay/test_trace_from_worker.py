"""`specgate trace calibrate --from-worker URL` (cli/trace.py) where it must refuse: a worker that
does not answer, and an SGLang server, which reports no step costs (a stand-in: tests/backends/
replay_server.py serving SGLang's recorded /server_info). A real worker's costs written to a file:
tests/integration/test_worker_step_costs.py. And `specgate replay --costs URL` / `policy explain --replay
--costs URL` (cli/costs.py): a worker's live costs price replay exactly as the same costs in a file do
(the stand-in serving a specgate worker's /server_info, scripted)."""

from __future__ import annotations

import asyncio

from cli import main
from tests.backends.replay_server import ReplayServer, Reply
from tests.gateway.gateway_helpers import closed_port as _closed_port


def from_worker(url: str, out) -> int:
    return main(["trace", "calibrate", "--from-worker", url, "--out", str(out)])


def test_a_worker_that_does_not_answer(capsys, tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    assert from_worker(url, tmp_path / "costs.json") == 2
    assert capsys.readouterr().err == (f"error: {url}: ConnectError: All connection attempts failed; start the "
                                       "worker, or give a cost model file (specgate trace calibrate --out FILE) "
                                       "(nothing written)\n")
    assert list(tmp_path.iterdir()) == []


def test_an_sglang_server_reports_no_step_costs(capsys, tmp_path):
    async def go():
        async with ReplayServer({("GET", "/server_info"): Reply.fixture("server_info.json")}) as sglang:
            return sglang.url, await asyncio.to_thread(from_worker, sglang.url, tmp_path / "costs.json")

    url, code = asyncio.run(go())
    assert code == 2
    assert capsys.readouterr().err == (
        f"error: {url}/server_info: field specgate_step_costs: empty or absent (an SGLang server reports none; a "
        "specgate worker once it calibrated or served); price replay with a cost model file instead: specgate "
        "trace calibrate --out FILE, or one filled from SGLang's benchmarks (docs/replay.md) (nothing written)\n")
    assert list(tmp_path.iterdir()) == []


def test_out_in_a_missing_directory(capsys, tmp_path):
    out = tmp_path / "nowhere" / "costs.json"
    assert from_worker("http://127.0.0.1:1", out) == 2
    assert capsys.readouterr().err == f"error: --out {out}: directory {out.parent} does not exist\n"


def test_the_summary_of_a_live_model_names_its_one_context_and_per_token_draft_costs():
    from cli.trace import _summary
    from policies.live_costs import from_server_info
    from tests.policies.costmodel_helpers import URL, report

    assert _summary(from_server_info(report(), URL)) == [
        "forward, width 1: 20.00 ms at context 32",
        "forward, width 9: 29.14 ms at context 32",  # 24 + (60 - 24) x 4 / 28: between widths 5 and 33
        "forward of 4 sequences, width 1 at context 32: 30.00 ms (1.50x one)",
        "forward of 16 sequences, width 1 at context 32: 80.00 ms (4.00x one)",
        "prefill, 33 tokens: 60.00 ms at context 32",
        "draft draft_model: 0.0 us per call, 4.00 ms per token at any context; once per request 0.0 us per "
        "prompt token",
        "draft ngram: 0.0 us per call, 0.00 ms per token at any context; once per request 0.0 us per prompt token",
        "overhead: 0.50 ms per round"]


def serving_report(body: bytes, run):
    """``run(url)`` in a thread while the stand-in answers GET /server_info with ``body``."""
    async def go():
        async with ReplayServer({("GET", "/server_info"): Reply(body=body)}) as worker:
            return worker.url, await asyncio.to_thread(run, worker.url)

    return asyncio.run(go())


def test_replay_priced_by_a_workers_live_costs_equals_the_same_costs_in_a_file(capsys, tmp_path):
    import msgspec

    from policies.costmodel import write_cost_model
    from policies.live_costs import from_server_info
    from tests.replay.replay_helpers import REQUESTS
    from tests.policies.costmodel_helpers import REVISION, report
    from policies.trace import FORMAT, Header, write_trace

    trace, cost_file = tmp_path / "trace.jsonl", tmp_path / "live.json"
    write_trace(trace, Header(format=FORMAT, model="m", revision=REVISION, tokenizer="t"), REQUESTS)
    args = ["--trace", str(trace), "--arms", "plain", "ngram-k4", "--loads", "c1", "c2", "--seeds", "2", "--processes", "1"]

    def run(url: str) -> int:
        write_cost_model(cost_file, from_server_info(report(), url))
        return main(["replay", *args, "--costs", url])

    url, code = serving_report(msgspec.json.encode(report()), run)
    live = capsys.readouterr()
    assert code == 0 and "error" not in live.err
    assert main(["replay", *args, "--costs", str(cost_file)]) == 0
    from_file = capsys.readouterr()
    assert live.out.replace(url, "SOURCE") == from_file.out.replace(str(cost_file), "SOURCE")
    assert "ngram-k4 / plain" in live.out


def test_replay_and_explain_refuse_a_worker_that_cannot_price(capsys, tmp_path):
    import msgspec

    from tests.replay.replay_helpers import REQUESTS
    from tests.policies.costmodel_helpers import REVISION, report
    from policies.trace import FORMAT, Header, write_trace

    trace = tmp_path / "trace.jsonl"
    write_trace(trace, Header(format=FORMAT, model="m", revision=REVISION, tokenizer="t"), REQUESTS)
    uncalibrated = msgspec.json.encode(report(specgate_step_costs_context=None))
    url, code = serving_report(uncalibrated, lambda url: main(
        ["replay", "--trace", str(trace), "--costs", url, "--arms", "plain", "--loads", "c1", "--seeds", "1"]))
    assert code == 1
    assert capsys.readouterr().err.startswith(
        f"error: {url}/server_info: field specgate_step_costs_context: not reported, so the context the table was "
        "measured at is unknown (the worker started with --no-calibrate)")
    down = f"http://127.0.0.1:{_closed_port()}"
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nslices:\n  - {name: prose}\npools:\n  plain: {proposer: none, workers: "
                      "['http://w:1']}\nrules:\n  - {name: all, then: bypass}\n")
    assert main(["policy", "explain", str(policy), "--replay", str(trace), "--costs", down]) == 1
    assert capsys.readouterr().err == (f"error: {down}: ConnectError: All connection attempts failed; start the "
                                       "worker, or give a cost model file (specgate trace calibrate --out FILE)\n")
