"""The replay simulator tests' hand-made cost model and trace requests (tests/replay/test_replay_sim.py and the
replay tests beside it): expected times are sums written out by hand from the formulas below."""

from __future__ import annotations

import msgspec

from replay.book import PLAIN, Option, RoundBook
from replay.choosers import FixedChooser, Prices
from replay.sim import Load, Simulation
from policies.costmodel import FORMAT as COSTS_FORMAT
from policies.costmodel import CostModel, DraftCost, Grid
from policies.features import RequestFeatures
from policies.trace import FORMAT, Header, Sampling, Served, Trace, TraceRequest

REVISION = "sha256:" + "ab" * 32
HEADER = Header(format=FORMAT, model="m", revision=REVISION, tokenizer="sha256:" + "cd" * 32)
OVERHEAD, NGRAM_CALL, DRAFT_CALL, DRAFT_TOKEN = 0.0003, 0.0005, 0.001, 0.002
NGRAM_SETUP = 2e-6  # per prompt token, once per request (indexing the prompt), paid by the first draft


def forward(tokens: int, context: int) -> float:
    """The target forward: 10 ms, +1 ms per token fed beyond the first, +10 us per cached token."""
    return 0.010 + 0.001 * (tokens - 1) + 1e-5 * context


def prefill(tokens: int, context: int) -> float:
    """A prefill chunk: 1 ms per token, +10 us per cached token."""
    return 0.001 * tokens + 1e-5 * context


# grids of the two formulas above: bilinear interpolation of a function without a cross term is exact
COSTS = CostModel(
    format=COSTS_FORMAT, model="m", revision=REVISION,
    forward=[Grid(tokens=[1, 17], context=[0, 1000],
                  seconds=[[forward(1, 0), forward(1, 1000)], [forward(17, 0), forward(17, 1000)]])],
    prefill=Grid(tokens=[1, 257], context=[0, 1000],
                 seconds=[[prefill(1, 0), prefill(1, 1000)], [prefill(257, 0), prefill(257, 1000)]]),
    draft={"ngram": DraftCost(call_s=NGRAM_CALL, setup_token_s=NGRAM_SETUP), "suffix": DraftCost(call_s=NGRAM_CALL),
           "draft_model": DraftCost(call_s=DRAFT_CALL, token_s=[DRAFT_TOKEN])},
    overhead_s=OVERHEAD)
TIGHT = 1e-12


def request(prompt_len: int, output_len: int, *, rid: str = "r", slice_: str = "code", arrival: float = 0.0,
            features: RequestFeatures | None = None, flags: dict[str, str] | None = None,
            prompt=None, output=None) -> TraceRequest:
    prompt = list(prompt) if prompt is not None else [1 + i % 50 for i in range(prompt_len)]
    output = list(output) if output is not None else [100 + i for i in range(output_len)]
    return TraceRequest(
        id=rid, arrival_s=arrival, route="default", slice=slice_,
        features=features or RequestFeatures(prompt_tokens=len(prompt), max_tokens=max(1, len(output))),
        sampling=Sampling(temperature=0.0, max_new_tokens=max(1, len(output))),
        served=Served(proposer="none", draft_tokens=0, finish="length"), draft_matches=flags or {},
        prompt_ids=prompt, output_ids=output)


def prices_of(*requests: TraceRequest, header: Header = HEADER) -> Prices:
    return Prices(RoundBook(Trace(header, list(requests))), COSTS)


def simulate(prices: Prices, load: str, order, *, option: Option = PLAIN, seed: int = 0, max_running: int = 16,
             max_total_tokens: int = 1 << 16, start: float = 0.0) -> dict[int, object]:
    """Request index -> Served, one fixed option on one worker; ``order``: the blocks of indices."""
    book = prices.book
    sim = Simulation(FixedChooser(option, prices, seed), Load.parse(load), order, seed, max_running=max_running,
                     max_total_tokens=max_total_tokens, arrival_of=lambda i: book.requests[i].arrival_s, start=start)
    return {s.index: s for s in sim.run()}


def copy_friendly(n: int) -> list[TraceRequest]:
    phrase = [11, 12, 13, 14, 15, 16]
    return [request(0, 0, rid=f"r{i}", slice_=("code", "prose")[i % 2], prompt=phrase * 3,
                    output=(phrase * 2)[: 8 + i % 5]) for i in range(n)]


def batched(four: float) -> CostModel:
    """COSTS measured at batch 1 and 4: a forward of 4 sequences costs ``four`` times one of 1."""
    grid = COSTS.forward[0]
    return msgspec.structs.replace(COSTS, batch=[1, 4], forward=[grid, Grid(
        tokens=grid.tokens, context=grid.context, seconds=[[four * v for v in row] for row in grid.seconds])])
