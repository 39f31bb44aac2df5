"""Counterfactual acceptance of the model-free proposers on recorded greedy requests: the exact core of
replay (issue 25) and of the proposer benchmark.

Greedy speculative decoding is exact: a request's output ids are the same under every proposer and draft
length. A model-free proposer (``ngram``, ``suffix``) is a deterministic function of what has been
committed, so the drafts it would make, and how many of them the target would accept, follow from the
prompt and output ids alone: for ``suffix`` also from the outputs its scope saw before, in arrival order.
``replay`` runs the engine's own proposer objects over the committed context round by round, exactly as
``Engine._round`` does (k capped at the tokens still allowed minus one; a round commits the accepted
prefix plus one token), so its rounds are the ones the engine would run. Time is not modelled here.

Sequential semantics: each request of a stream starts after the previous one completed (its whole output
is in the scope's tree). Concurrent requests see each other's partial outputs in the engine; replaying
them needs their round timing, which a recorded trace has.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from backends.engine.proposers.base import SequenceProposer
from backends.engine.proposers.ngram import NgramProposer
from backends.engine.proposers.suffix import SuffixStore
from backends.engine.types import SamplingParams, SpeculationParams, SuffixSettings

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
    prompt, output = list(record.prompt), list(record.output)
    rounds = _Rounds()
    generator = torch.Generator()
    done = 0
    while done < len(output):
        context = prompt + output[:done]
        budget = min(k, record.max_new_tokens - done - 1) if proposer is not None else 0
        drafts = proposer.propose(context, budget, GREEDY, None, generator).tokens if budget > 0 else []
        accepted = 0
        while accepted < len(drafts) and done + accepted < len(output) and drafts[accepted] == output[done + accepted]:
            accepted += 1
        done = min(len(output), done + accepted + 1)
        rounds.drafted.append(len(drafts))
        rounds.accepted.append(accepted)
        if proposer is not None:
            proposer.observe(len(drafts), accepted, prompt + output[:done])
    if proposer is not None:
        proposer.release()
    return Replayed(tuple(rounds.drafted), tuple(rounds.accepted))


def replay(records: Iterable[Recorded], spec: SpeculationParams,
           suffix: SuffixSettings = SuffixSettings()) -> list[Replayed]:
    """Every request of a stream, in arrival order, under ``spec`` (plain, ``ngram`` or ``suffix``; a
    fixed ``draft_tokens``). One suffix store serves the whole stream, as one worker would."""
    if spec.adaptive or spec.proposer not in ("none", "ngram", "suffix"):
        raise ValueError(f"no exact counterfactual for proposer {spec.proposer!r} (adaptive={spec.adaptive}): "
                         "only model-free proposers with a fixed draft length are a function of the trace")
    store = SuffixStore(suffix) if spec.proposer == "suffix" else None
    results = []
    for record in records:
        proposer: SequenceProposer | None = None
        if spec.proposer == "ngram":
            proposer = NgramProposer(spec.ngram_min, spec.ngram_max, spec.ngram_match)
        elif store is not None:
            proposer = store.open(record.scope, list(record.prompt))
        results.append(replay_request(proposer, record, spec.draft_tokens))
    return results


def mean_accept_length(results: Sequence[Replayed]) -> float:
    """Committed tokens per target forward over a set of requests (tokens and rounds summed)."""
    rounds = sum(r.rounds for r in results)
    return sum(sum(r.accepted) + r.rounds for r in results) / rounds if rounds else 0.0
