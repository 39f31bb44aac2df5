"""Counterfactual acceptance of every engine proposer on recorded greedy requests: the exact core of
replay (docs/replay.md) and of the proposer benchmark.

Greedy speculative decoding is exact: a request's output ids are the same under every proposer and draft
length. A model-free proposer (``ngram``, ``suffix``) is a deterministic function of what has been
committed, so the drafts it would make, and how many of them the target would accept, follow from the
prompt and output ids alone: for ``suffix`` also from the outputs its scope saw before, in arrival order;
``hybrid`` with a fixed k (both of them, one chosen per round by a rule that reads only what was committed,
learning across the stream as the engine's pooled acceptance does) likewise.
``replay`` runs the engine's own proposer objects over the committed context round by round, exactly as
``Engine._round`` does (k capped at the tokens still allowed minus one; a round commits the accepted
prefix plus one token), so its rounds are the ones the engine would run. Time is not modelled here.

The ``draft_model`` proposer is greedy too: after an accepted prefix its context is the committed one, so
its j-th draft of a round starting at output position i is its argmax given ``prompt + output[:i + j]``
as long as drafts 1..j-1 matched. One teacher-forced draft forward over ``prompt + output``
(:func:`draft_matches`, the only model call here) gives for every position i whether that argmax is
``output[i]``; a round from i with budget k accepts the run of matches from i, capped at k. Replay takes
those flags, not the model (:class:`MatchedDrafts`). The teacher-forced forward and the engine's
incremental ones compute the same logits in a different order, so a position whose top two draft logits
are within float rounding can flip: :class:`DraftMatches` keeps each position's margin so a caller can
count them, and the measured agreement is in docs/replay.md.

Sequential semantics: each request of a stream starts after the previous one completed (its whole output
is in the scope's tree). Concurrent requests see each other's partial outputs in the engine; replaying
them needs their round timing, which a recorded trace has.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from backends.engine.proposers.base import EMPTY, Proposal, SequenceProposer
from backends.engine.proposers.hybrid import HybridProposer
from backends.engine.proposers.ngram import NgramProposer
from backends.engine.proposers.suffix import SuffixStore
from backends.engine.sampling import PenaltyState, needs_history, process_logits
from backends.engine.source_choice import rule_for
from backends.engine.types import SamplingParams, SpeculationParams, SuffixSettings

if TYPE_CHECKING:
    from backends.engine.runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True, slots=True)
class Recorded:
    """One served greedy request: what was asked and what was committed."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    max_new_tokens: int  # the request's limit (k is capped by what it still allows)
    scope: str = ""


@dataclass(frozen=True, slots=True)
class Replayed:
    drafted: tuple[int, ...] = ()  # tokens proposed per round (target forwards = rounds)
    accepted: tuple[int, ...] = ()

    @property
    def rounds(self) -> int:
        return len(self.drafted)

    @property
    def accept_length(self) -> float:
        """Committed tokens per target forward (the accepted drafts plus the one token every round adds)."""
        return (sum(self.accepted) + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass
class _Rounds:
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)


def replay_request(proposer: SequenceProposer | None, record: Recorded, k: int) -> Replayed:
    """The rounds ``proposer`` (None: plain decoding) would run on ``record`` with draft length ``k``."""
    output = list(record.output)
    context = list(record.prompt)  # grows by the committed tokens, as the engine's sequence does (proposers read it)
    rounds = _Rounds()
    generator = torch.Generator()
    done = 0
    while done < len(output):
        budget = min(k, record.max_new_tokens - done - 1) if proposer is not None else 0
        drafts = proposer.propose(context, budget, GREEDY, None, generator).tokens if budget > 0 else []
        accepted = 0
        while accepted < len(drafts) and done + accepted < len(output) and drafts[accepted] == output[done + accepted]:
            accepted += 1
        committed = min(len(output), done + accepted + 1)
        context += output[done:committed]
        done = committed
        rounds.drafted.append(len(drafts))
        rounds.accepted.append(accepted)
        if proposer is not None:
            proposer.observe(len(drafts), accepted, context)
    if proposer is not None:
        proposer.release()
    return Replayed(tuple(rounds.drafted), tuple(rounds.accepted))


def replay(records: Iterable[Recorded], spec: SpeculationParams, suffix: SuffixSettings = SuffixSettings(),
           matches: Sequence[Sequence[bool]] | None = None) -> list[Replayed]:
    """Every request of a stream, in arrival order, under ``spec`` (plain, ``ngram``, ``suffix``, ``hybrid``
    or ``draft_model``; a fixed ``draft_tokens``). One suffix store serves the whole stream, as one worker
    would, and for ``hybrid`` one pooled acceptance (the engine's, across its sequences: its rule learns from
    every earlier request of the stream). ``draft_model`` needs ``matches``: per record, the draft's match
    flags (:func:`draft_matches` with the draft of the pair being replayed), one per output token."""
    if spec.adaptive or spec.proposer not in ("none", "ngram", "suffix", "hybrid", "draft_model"):
        raise ValueError(f"no exact counterfactual for proposer {spec.proposer!r} (adaptive={spec.adaptive}): "
                         "only greedy proposers with a fixed draft length are a function of the trace")
    records = list(records)
    if spec.proposer == "draft_model":
        if matches is None:
            raise ValueError("proposer draft_model needs matches: the draft's teacher-forced match flags per "
                             "record (counterfactual.draft_matches)")
        if len(matches) != len(records):
            raise ValueError(f"matches has {len(matches)} entries for {len(records)} records")
    store = SuffixStore(suffix) if spec.proposer in ("suffix", "hybrid") else None
    shared: dict = {}  # the engine's shared controllers: hybrid's pooled acceptance
    results = []
    for n, record in enumerate(records):
        proposer: SequenceProposer | None = None
        if spec.proposer == "ngram":
            proposer = NgramProposer(spec.ngram_min, spec.ngram_max, spec.ngram_match)
        elif spec.proposer == "hybrid":  # a fixed k: the rule reads posterior means, never costs or draws
            proposer = HybridProposer(NgramProposer(spec.ngram_min, spec.ngram_max, spec.ngram_match),
                                      store.open(record.scope, list(record.prompt)),
                                      rule_for(spec, _no_costs, seed=0, shared=shared))
        elif store is not None:
            proposer = store.open(record.scope, list(record.prompt))
        elif matches is not None and spec.proposer == "draft_model":
            proposer = MatchedDrafts(record, matches[n], where=f"record {n}")
        results.append(replay_request(proposer, record, spec.draft_tokens))
    return results


def _no_costs(k_max: int) -> list[float]:
    raise AssertionError("a fixed draft length never prices rounds")


NO_TOKEN = -1  # a draft token replay does not know (never equal to a token id)


class MatchedDrafts(SequenceProposer):
    """The greedy draft model as replay sees it: at output position i the draft's argmax is ``output[i]``
    exactly when ``matches[i]``. A round's drafts are the committed tokens up to the first mismatch, then
    ``NO_TOKEN`` up to k: which token the draft would have put there does not change what is accepted (the
    run of matches from the round's start, capped at k). Like the engine's draft model it always drafts k."""

    name = "draft_model"

    def __init__(self, record: Recorded, matches: Sequence[bool], where: str = "record") -> None:
        if len(matches) != len(record.output):
            raise ValueError(f"{where}: {len(matches)} match flags for {len(record.output)} output tokens")
        self.start = len(record.prompt)
        self.output = record.output
        self.matches = tuple(bool(m) for m in matches)

    def propose(self, context: list[int], k: int, params: SamplingParams, penalty: PenaltyState | None,
                generator: torch.Generator) -> Proposal:
        i = len(context) - self.start  # output tokens committed so far
        run = 0
        while run < k and i + run < len(self.matches) and self.matches[i + run]:
            run += 1
        tokens = list(self.output[i:i + run]) + [NO_TOKEN] * (k - run)
        return Proposal(tokens=tokens, draft_probs=None, seconds=0.0) if tokens else EMPTY


@dataclass(frozen=True, slots=True)
class DraftMatches:
    """One teacher-forced draft pass over a request. ``matches[i]``: the draft's processed argmax given
    ``prompt + output[:i]`` is ``output[i]``. ``margins[i]``: its top logit minus the runner-up (>= 0; 0 is
    a tie, broken towards the lower id as torch.argmax does): where it is within float rounding the engine's
    incremental forwards may pick the other token. Measured on SmolLM2 in fp32 (self-draft of 8 and 20
    layers, 48 positions): teacher-forced and incremental logits differ by at most 7.3e-5 (logits up to
    ~80), so a margin under 1e-3 is a near tie."""

    matches: tuple[bool, ...]
    margins: tuple[float, ...]

    def near_ties(self, below: float) -> int:
        """Positions whose margin is under ``below``: those whose flag float rounding could flip."""
        return sum(m < below for m in self.margins)


@torch.inference_mode()
def draft_matches(runner: ModelRunner, prompt: Sequence[int], output: Sequence[int],
                  params: SamplingParams = GREEDY, stop_ids: frozenset[int] = frozenset(),
                  chunk: int = 256) -> DraftMatches:
    """Feed ``prompt + output[:-1]`` through the draft ``runner`` once (its logits kept ``chunk`` output
    positions at a time) and compare each position's argmax with the committed token. The logits are
    processed as the engine's draft processes them (penalties and min_new_tokens over the committed
    history, ``stop_ids`` = the request's stop tokens), so requests with penalties replay exactly too;
    only greedy ones have a counterfactual."""
    if not params.greedy:
        raise ValueError(f"temperature {params.temperature}: only greedy requests have exact draft matches")
    if not prompt:
        raise ValueError("prompt is empty")
    output = list(output)
    ids = [*prompt, *output[:-1]]
    first = len(prompt) - 1  # the position whose logits predict output[0]
    state = PenaltyState.create(tuple(prompt), runner.vocab_size) if needs_history(params) else None
    cache = runner.new_cache()
    matches: list[bool] = []
    margins: list[float] = []
    fed = 0
    while len(matches) < len(output):
        done = len(matches)
        end = min(len(ids), first + done + chunk)
        logits = runner.forward(cache, ids[fed:end], keep=end - first - done).logits  # [m, vocab]
        fed = end
        history = output[done:end - first]  # the committed tokens these positions predict, in order
        scaled = process_logits(logits, params, state, history, stop_ids)
        top = torch.topk(scaled, 2, dim=-1)
        chosen = scaled.argmax(dim=-1).tolist()
        matches += [c == t for c, t in zip(chosen, history)]
        margins += (top.values[:, 0] - top.values[:, 1]).tolist()
        if state is not None:
            state.commit(history)
    return DraftMatches(tuple(matches), tuple(margins))


def mean_accept_length(results: Sequence[Replayed]) -> float:
    """Committed tokens per target forward over a set of requests (tokens and rounds summed)."""
    rounds = sum(r.rounds for r in results)
    return sum(sum(r.accepted) + r.rounds for r in results) / rounds if rounds else 0.0
