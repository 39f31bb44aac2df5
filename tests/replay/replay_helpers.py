"""The synthetic trace and hand-made cost model of the replay CLI tests (tests/replay/test_replay_cli.py), whose
replayed TPOTs are computed here by hand; tests of replay's reports, candidates and fidelity use them too."""

from __future__ import annotations

from policies.costmodel import FORMAT as COSTS_FORMAT
from policies.costmodel import CostModel, DraftCost, Grid, write_cost_model
from policies.features import RequestFeatures
from policies.trace import FORMAT, Header, Sampling, Served, TraceRequest, write_trace

REVISION = "sha256:" + "ab" * 32
OTHER = "sha256:" + "ef" * 32
OVERHEAD, CALL, SETUP = 0.0003, 0.0005, 2e-6
PHRASE = [11, 12, 13, 14, 15, 16]


def forward(tokens: int, context: int) -> float:
    return 0.010 + 0.001 * (tokens - 1) + 1e-5 * context


def prefill(tokens: int, context: int) -> float:
    return 0.001 * tokens + 1e-5 * context


def costs(revision: str = REVISION) -> CostModel:
    return CostModel(
        format=COSTS_FORMAT, model="m", revision=revision,
        forward=[Grid(tokens=[1, 17], context=[0, 1000],
                      seconds=[[forward(1, 0), forward(1, 1000)], [forward(17, 0), forward(17, 1000)]])],
        prefill=Grid(tokens=[1, 257], context=[0, 1000],
                     seconds=[[prefill(1, 0), prefill(1, 1000)], [prefill(257, 0), prefill(257, 1000)]]),
        draft={"ngram": DraftCost(call_s=CALL, setup_token_s=SETUP), "suffix": DraftCost(call_s=CALL)},
        overhead_s=OVERHEAD)


def request(rid: str, slice_: str, prompt: list[int], output: list[int], code_score: float) -> TraceRequest:
    return TraceRequest(
        id=rid, arrival_s=0.0, route="default", slice=slice_,
        features=RequestFeatures(prompt_tokens=len(prompt), max_tokens=len(output), code_score=code_score),
        sampling=Sampling(temperature=0.0, max_new_tokens=len(output)),
        served=Served(proposer="none", draft_tokens=0, finish="length"), prompt_ids=prompt, output_ids=output)


# code: the output copies the prompt's phrase (n-gram k = 4 commits 5, 5, 2 tokens in 3 rounds); prose: no
# token of the output occurs earlier, so n-gram never drafts and only pays its propose calls
REQUESTS = [request("c1", "code", PHRASE * 3, PHRASE * 2, 0.5), request("p1", "prose", list(range(1, 19)),
                                                                       list(range(31, 43)), 0.1),
            request("c2", "code", PHRASE * 3, PHRASE * 2, 0.5), request("p2", "prose", list(range(1, 19)),
                                                                       list(range(31, 43)), 0.1)]
# every request: 18 prompt tokens (17 prefilled), 12 output tokens; plain steps at 17..28 cached tokens
PLAIN_TPOT = sum(forward(1, 17 + i) + OVERHEAD for i in range(1, 12)) / 11
CODE_NGRAM_TPOT = (CALL + forward(5, 22) + OVERHEAD + CALL + forward(2, 27) + OVERHEAD) / 11
PROSE_NGRAM_TPOT = PLAIN_TPOT + 10 * CALL / 11  # rounds 2..11 propose (nothing); the 12th has no budget
CODE_RATIO, PROSE_RATIO = CODE_NGRAM_TPOT / PLAIN_TPOT, PROSE_NGRAM_TPOT / PLAIN_TPOT

PINNED = f"""version: 1
slo: {{ttft_ms: 900, tpot_ms: 40}}
slices:
  - {{name: code, when: {{code_score: {{gte: 0.3}}}}}}
  - {{name: prose}}
pairs:
  p: {{target: {{model: m, revision: "{REVISION}"}}, draft: {{kind: ngram}}}}
pools:
  plain: {{proposer: none, workers: ["http://w:1"]}}
  ngram: {{proposer: ngram, draft_tokens: 4, pair: p, workers: ["http://w:1"]}}
rules:
  - {{name: code-copies, when: {{slice: code}}, then: {{pool: ngram, draft_tokens: 4}}}}
  - {{name: rest, then: bypass}}
"""
BYPASS = PINNED.replace("{ttft_ms: 900, tpot_ms: 40}", "{ttft_ms: 100, tpot_ms: 5}").replace(
    "  - {name: code-copies, when: {slice: code}, then: {pool: ngram, draft_tokens: 4}}\n", "")


def write_files(tmp_path) -> tuple:
    """The synthetic trace and cost model written under ``tmp_path``: (trace path, cost file path)."""
    trace, cost_file = tmp_path / "trace.jsonl", tmp_path / "costs.json"
    write_trace(trace, Header(format=FORMAT, model="m", revision=REVISION, tokenizer="t"), REQUESTS)
    write_cost_model(cost_file, costs())
    return trace, cost_file
