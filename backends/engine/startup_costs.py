"""The engine's start-up calibration (``Engine.calibrate``, unless the worker runs with ``--no-calibrate``): the
seconds of target forwards of a few shapes (``measure_steps``), of each proposer's drafts and of a round's overhead
(``measure_rounds``), into its ``StepCosts``, which prices per-round draft lengths from the first request and which
``/server_info`` reports (replay reads it through ``policies.live_costs``). ``specgate trace calibrate``'s fuller
measurement of a cost model file is backends/engine/calibrate.py; this one takes a few seconds at start-up.
"""

from __future__ import annotations

import time

import torch

from backends.engine.calibrate import GREEDY, greedy_request, run_rounds, seeded_suffix_store
from backends.engine.proposers.draft_model import DraftModelProposer
from backends.engine.proposers.ngram import NgramProposer
from backends.engine.runner import Feed
from backends.engine.types import SpeculationParams

CALIBRATION_WIDTHS = (1, 2, 3, 5, 9, 17, 33)  # tokens of one sequence; others interpolate (StepCosts.forward)
CALIBRATION_BATCHES = (4, 16)  # sequences per calibrated step, of 1 and of 5 tokens each


def measure_steps(runner, costs, *, context: int = 32, repeats: int = 1) -> None:
    """The engine's start-up calibration of its per-round cost model (``step_costs.StepCosts``): one sequence
    at each of CALIBRATION_WIDTHS, and CALIBRATION_BATCHES sequences of 1 and 5 tokens each, after a
    ``context``-token prefix, recorded as ``costs.context``. Live steps refine every shape through the same EMA."""
    prompt = list(range(100, 100 + context))
    shapes = [(1, w) for w in CALIBRATION_WIDTHS] + [(n, w) for n in CALIBRATION_BATCHES for w in (1, 5)]
    for seqs, width in shapes:
        for _ in range(repeats):
            caches = [runner.new_cache() for _ in range(seqs)]
            runner.forward_batch([Feed(cache, prompt, 1) for cache in caches])
            fed = list(range(200, 200 + width))
            result = runner.forward_batch([Feed(cache, fed, width) for cache in caches])
            costs.observe_forward(result.tokens, result.seconds, seqs=seqs)
    costs.context = context  # what /server_info reports beside the table (specgate_step_costs_context)


STARTUP_DRAFTS = 4  # drafts per timed start-up proposal (the default policy's fixed pools draft 1-8)
STARTUP_CALLS = 6  # timed proposals per proposer at start-up


def measure_rounds(engine, *, context: int = 32) -> None:
    """The start-up calibration's second half: each proposer's seconds per drafted token and a round's overhead,
    recorded into ``engine.costs`` by the calls live rounds use (``observe_draft``, and the engine's own rounds
    for the overhead), so that a worker that has served nothing can already price speculative rounds
    (``/server_info``'s ``specgate_draft_token_s``, which replay reads through ``policies.live_costs``).

    The context repeats a 4-token cycle, so n-gram and suffix find drafts. Proposals are timed on contexts
    growing by one token, as a request's successive rounds are; the draft model's first call (its prefill) is
    not counted. Suffix drafts from a store of its own, so no serving scope sees these tokens; the overhead comes
    from one plain request of 8 tokens stepped here (the engine is not started yet), whose forwards are not kept.
    A proposer that cannot run here (suffix without arctic-inference) is left out: live rounds fill it in."""
    costs = engine.costs
    ids = [300 + i % 4 for i in range(context + STARTUP_CALLS + 1)]
    generator = torch.Generator().manual_seed(0)
    spec = SpeculationParams()

    def time_proposals(name: str, proposer, first_counts: bool = True) -> None:
        for n in range(STARTUP_CALLS + (0 if first_counts else 1)):
            start = time.perf_counter()
            proposal = proposer.propose(ids[:context + n], STARTUP_DRAFTS, GREEDY, None, generator)
            seconds = time.perf_counter() - start
            if first_counts or n:
                costs.observe_draft(name, len(proposal.tokens), seconds)
        proposer.release()

    time_proposals("ngram", NgramProposer(spec.ngram_min, spec.ngram_max, spec.ngram_match))
    time_proposals("draft_model", DraftModelProposer(engine.draft_runner, engine.eos_ids), first_counts=False)
    try:
        store = seeded_suffix_store(engine, [300 + i % 4 for i in range(16 * 96)])
    except RuntimeError:  # arctic-inference missing: the suffix proposer cannot run on this worker either
        pass
    else:
        time_proposals("suffix", store.open("calibrate", ids[:context]))
    table = dict(costs.forward_s)
    run_rounds(engine, greedy_request("calibrate-overhead", ids[:context], 8))
    costs.restore(table)  # its prefill and rounds ran at other contexts than the table's: only the overhead stays
