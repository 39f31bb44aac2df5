"""The sweep behind ``specgate replay``: every contender (a fixed arm or a policy file) at every load and
seed, simulated (replay/sim.py), in parallel worker processes.

Seeds vary what is random in serving: the order of an interleaved stream (seed-shuffled), the Poisson
gaps, the policy's exploration draws and the estimated rounds of sampled requests. A fixed arm with exact
rounds under closed-loop clients in by-slice order has nothing random, so it runs once and its result
stands for every seed (said in the report: its interval is zero).
"""

from __future__ import annotations

import multiprocessing
import random
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from policies.errors import PolicyError
from policies.load import load_policy_file
from policies.schema import parse_k_by_batch
from replay.book import PLAIN, Option, RoundBook
from replay.choosers import FixedChooser, PolicyChooser, Prices
from replay.hybrid import HALVES
from replay.sim import Load, Served, Simulation

MIXES = ("interleaved", "by-slice")
_ARM = re.compile(r"^(?P<proposer>ngram|suffix|hybrid|draft(?P<layers>\d+)?)-k(?P<k>\d+)"
                  r"(?:-(?P<strategy>beta|sglang|vllm|oracle|informed)(?:=(?P<table>[0-9:,-]+)|=(?P<features>[a-z+]+))?)?$")


@dataclass(frozen=True)
class Contender:
    name: str
    option: Option | None = None  # an arm
    policy: object = None  # a policies.schema.Policy
    path: str = ""
    without_flags: str = "refuse"  # a draft_model pool without match flags: refuse, or exclude (PolicyChooser)

    @property
    def is_policy(self) -> bool:
        return self.policy is not None


def parse_arm(name: str, book: RoundBook) -> Contender:
    """``plain``, ``ngram-k4``, ``suffix-k8``, ``draft-k4`` (the trace's self-draft pair; ``draft20-k4`` picks
    the 20-layer one when the trace carries several). A per-round draft length up to k appends the engine's
    controller (backends/engine/adaptive.py, baselines.py): ``ngram-k8-beta`` (specgate's), ``ngram-k7-sglang``
    (SGLang's --speculative-adaptive), ``ngram-k8-vllm=1:8,4:4,16:2`` (vLLM's per-batch-size table, LO:K or LO-HI:K);
    ``ngram-k16-oracle`` and ``ngram-k16-informed`` are replay's references (replay/walk.Clairvoyant: one
    knows every round's accepted run, the other the trace's acceptance by match context), for n-gram only;
    ``ngram-k16-informed=request+match`` keys the rates by other features known before a round is verified
    (book.FEATURES, joined by +). ``hybrid-k8`` drafts from n-gram and suffix every round and its rule picks
    the source (the engine's, replay/hybrid.py), ``hybrid-k16-beta`` also k per round; ``hybrid-k16-oracle``
    knows every round's accepted run of both sources, and its halves ``hybrid-k16-oracle=source`` (the source
    with the longer run, the rule's k on it) and ``hybrid-k16-oracle=k`` (the rule's source, cut at its run)
    say which of the two choices the rule's gap to it comes from."""
    if name == "plain":
        return Contender(name, PLAIN)
    match = _ARM.match(name)
    if (match is None or not 1 <= int(match["k"]) <= 16 or (match["table"] is None) != (match["strategy"] != "vllm")
            or (match["features"] is not None and match["strategy"] != "informed"
                and (match["proposer"], match["strategy"]) != ("hybrid", "oracle"))):
        raise ValueError(f"--arms: {name!r} is not an arm; use plain, ngram-kN, suffix-kN, hybrid-kN, draft-kN or "
                         "draftL-kN (L layers of the self-draft), N in 1..16, optionally with a per-round controller: "
                         "-beta, -sglang, -vllm=TABLE (e.g. ngram-k8-vllm=1:8,4:4,16:2), or a reference: -oracle or "
                         "-informed[=FEATURES] (n-gram only, e.g. ngram-k16-informed=request+match; "
                         "hybrid-k16-oracle)")
    k, proposer = int(match["k"]), match["proposer"]
    strategy = match["strategy"] or ""
    table = ()
    if match["table"]:
        table = parse_k_by_batch(match["table"])
    if strategy in ("oracle", "informed") and not (proposer == "ngram" or (proposer, strategy) == ("hybrid", "oracle")):
        raise ValueError(f"--arms {name}: the references (-oracle, -informed) replay n-gram drafts only "
                         f"(ngram-kN-{strategy}), and -oracle n-gram and suffix together (hybrid-kN-oracle)")
    if proposer in ("ngram", "suffix", "hybrid"):
        features = match["features"] or ""
        if proposer == "hybrid" and strategy == "oracle" and features:
            if features not in HALVES:
                raise ValueError(f"--arms {name}: the hybrid oracle's halves are hybrid-kN-oracle=source and "
                                 "hybrid-kN-oracle=k")
        elif features:
            book.check_features(features)
        option = Option(proposer, k, strategy=strategy, table=table, features=features)
        book.check(option)
        return Contender(name, option)
    pairs = {v: p for v, p in book.trace.header.pairs.items() if p.draft.kind == "layer_truncated"}
    if match["layers"]:
        pairs = {v: p for v, p in pairs.items() if p.draft.layers == int(match["layers"])}
    if len(pairs) != 1:
        have = ", ".join(f"{p.draft.layers} layers ({v})" for v, p in book.trace.header.pairs.items()) or "none"
        raise ValueError(f"--arms {name}: the trace carries {len(pairs)} matching self-draft pairs (it has: {have}); "
                         "name the layers (draft8-k4), or rebuild the trace with --draft-layers N")
    option = Option("draft_model", k, next(iter(pairs)), strategy=strategy, table=table)
    book.check(option)
    return Contender(name, option)


def blocks(book: RoundBook, mix: str, seed: int) -> list[list[int]]:
    """The arrival order: one seed-shuffled stream of every request (interleaved), one block per slice
    label in the trace's order (by-slice, as the serving benchmark's cells), or the trace's own order
    (recorded: what the ``trace`` load replays, at the recorded times)."""
    indices = [i for i, r in enumerate(book.requests) if r.output_ids]
    if mix == "recorded":  # the trace load: every request at its recorded time, whatever --mix says
        return [indices]
    if mix == "interleaved":
        random.Random(f"order:{seed}").shuffle(indices)
        return [indices]
    by: dict[str, list[int]] = {}
    for i in indices:
        by.setdefault(book.requests[i].slice, []).append(i)
    return list(by.values())


@dataclass(frozen=True, slots=True)
class Job:
    contender: int
    load: str
    seed: int


def seedless(contender: Contender, load: Load, mix: str, book: RoundBook) -> bool:
    """Whether the contender's result at ``load`` is the same for every seed."""
    return (not contender.is_policy and contender.option.proposer not in ("suffix", "hybrid")
            and not contender.option.strategy
            and (mix == "by-slice" or load.label == "trace") and load.rate is None
            and all(r.sampling.greedy for r in book.requests))


_CONTEXT: dict = {}


def _run(job: Job) -> tuple[Job, list[Served]]:
    c = _CONTEXT
    contender = c["contenders"][job.contender]
    prices: Prices = c["prices"]
    load = Load.parse(job.load)
    book = prices.book
    given = c.get("order")
    if given is not None:  # the caller's own blocks (a serving run's order: bench.replay_fidelity)
        key, order = ("given", 0), given
    else:
        key = (c["mix"], job.seed if c["mix"] == "interleaved" else 0)
        order = blocks(book, "recorded" if load.label == "trace" else c["mix"], job.seed)
    chooser = (PolicyChooser(contender.policy, prices, job.seed, without_flags=contender.without_flags)
               if contender.is_policy
               else FixedChooser(contender.option, prices, job.seed, key if load.label != "trace" else None))
    sim = Simulation(chooser, load, order, job.seed, max_running=c["max_running"],
                     max_total_tokens=c["max_total_tokens"], arrival_of=lambda i: book.requests[i].arrival_s)
    served = sim.run()
    return job, served


def sweep(prices: Prices, contenders: Sequence[Contender], loads: Sequence[str], seeds: int, mix: str, *,
          max_running: int, max_total_tokens: int, processes: int = 1, progress=None,
          order: Sequence[Sequence[int]] | None = None) -> dict[tuple[str, str, int], list[Served]]:
    """(contender name, load, seed) -> served requests. ``progress(done, total)`` after each job. ``order``:
    blocks of request indices to serve instead of ``mix``'s (each block after the previous one has finished),
    the same for every seed and load: a recorded run's own order."""
    if mix not in MIXES:
        raise ValueError(f"--mix: {mix!r}; use one of {', '.join(MIXES)}")
    book = prices.book
    jobs, copies = [], []
    for n, contender in enumerate(contenders):
        for label in loads:
            load = Load.parse(label)
            if seedless(contender, load, "by-slice" if order is not None else mix, book):
                jobs.append(Job(n, label, 0))
                copies.append((contender.name, label))
            else:
                jobs += [Job(n, label, s) for s in range(seeds)]
    # one contender's runs together, seed-major, a chunk per (contender, seed): a process reuses its profiles
    # and the seed's suffix rounds at every load, and a policy's seeds still spread over the processes
    jobs.sort(key=lambda j: (j.contender, j.seed, loads.index(j.load)))
    _CONTEXT.update(contenders=list(contenders), prices=prices, mix=mix, max_running=max_running,
                    max_total_tokens=max_total_tokens, order=order)
    results: dict[tuple[str, str, int], list[Served]] = {}
    done = 0
    if processes > 1 and len(jobs) > 1:
        _prepare(prices, contenders)
        with multiprocessing.get_context("fork").Pool(processes, initializer=_default_signals) as pool:
            for job, served in pool.imap_unordered(_run, jobs, chunksize=len(loads)):
                results[(contenders[job.contender].name, job.load, job.seed)] = served
                done += 1
                if progress:
                    progress(done, len(jobs))
    else:
        for job in jobs:
            job, served = _run(job)
            results[(contenders[job.contender].name, job.load, job.seed)] = served
            done += 1
            if progress:
                progress(done, len(jobs))
    for name, label in copies:
        for s in range(1, seeds):
            results[(name, label, s)] = results[(name, label, 0)]
    return dict(sorted(results.items()))


def _default_signals() -> None:
    """In each forked worker: SIGTERM back to its default. A handler the parent installed (a CLI that unwinds on
    SIGTERM) would otherwise outlive the pool's terminate at its end, and the pool would wait on that worker
    forever."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _prepare(prices: Prices, contenders: Sequence[Contender]) -> None:
    """Before the fork: what every worker process would compute alike, once (the children inherit it): the
    proposer replay's imports, and each fixed arm's exact profiles of the greedy requests (its rounds depend
    on the request alone; n-gram rounds take ~1.7 ms a request)."""
    import backends.engine.counterfactual  # noqa: F401  (imports torch: ~1.5 s in every child otherwise)

    requests = prices.book.requests
    for contender in contenders:
        if contender.is_policy or contender.option.strategy or contender.option.proposer in ("suffix", "hybrid"):
            continue
        chooser = FixedChooser(contender.option, prices, 0)
        for i, r in enumerate(requests):
            if r.output_ids and r.sampling.greedy:
                prices.profile(i, contender.option, chooser.run)


def load_policy(path: str | Path):
    """A policy file, refused with ``policy check``'s own errors when invalid."""
    try:
        return load_policy_file(path)
    except PolicyError as exc:
        raise ValueError(f"--policy {path}: invalid policy (specgate policy check {path}):\n"
                         + "\n".join(exc.errors)) from None

