"""A worker's scripted ``/server_info`` with live step costs, for the tests that turn it into a replay cost model
(tests/policies/test_costmodel_from_worker.py, tests/replay/test_trace_from_worker.py)."""

from __future__ import annotations

from backends.sglang.wire import ServerInfo

URL = "http://127.0.0.1:30000"
REVISION = "sha256:" + "ab" * 32
# [sequences, tokens in the step, seconds]: one sequence at 4 widths (a calibration's and a prefill chunk's),
# 4 and 16 sequences of 1 and 5 tokens each, and a mixed step of 4 sequences (7 tokens: 3 plain, one round
# of 3 drafts) that has no width per sequence
TABLE = [(1, 1, 0.020), (1, 2, 0.021), (1, 5, 0.024), (1, 33, 0.060), (4, 4, 0.030), (4, 7, 0.033),
         (4, 20, 0.050), (16, 16, 0.080), (16, 80, 0.200)]


def report(**changes) -> ServerInfo:
    fields = dict(served_model_name="SmolLM2-135M-Instruct", model_path="/models/smol", revision=REVISION,
                  dtype="float32", specgate_step_costs=TABLE, specgate_step_costs_context=32,
                  specgate_draft_token_s={"draft_model": 0.004, "ngram": 2e-06}, specgate_round_overhead_s=0.0005)
    return ServerInfo(**{**fields, **changes})
