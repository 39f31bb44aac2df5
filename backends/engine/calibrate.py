"""Measure the replay cost model on the embedded engine: ``specgate trace calibrate``.

The engine takes settings, not policy types: :func:`calibrate` returns the measurements as plain data in the
cost model file's shape (``policies/costmodel.py``; ``policies.costmodel.from_measurements`` checks and types
them), and :func:`self_check` takes the model's ``round_s`` as a function.

Every number is a median of real engine work, timed the way the engine times it, after one warm-up:

- **Target forwards.** One KV cache grows through the contexts with real token ids (a real text's ids,
  never random ids); at each context L every width w is fed as ``runner.forward(cache, ids[L:L + w],
  keep=w)`` (what a round feeds: the last committed token and w - 1 drafts) and rolled back to L. Widths
  are interleaved within each repeat, so load that comes and goes spreads over all of them instead of
  bending one. Prefill chunks: ``forward`` of t new tokens after L with ``keep=1``, from L = 0.
- **Batched steps.** The engine runs one forward per step for every running sequence
  (``runner.forward_batch``), so the forward grid is measured again for each batch size b > 1: b caches
  grown through the same contexts, every width fed by all b sequences in ONE ``forward_batch``, rolled back.
- **draft_model.** The layer-truncated self-draft's own ``DraftModelProposer``, called as the engine calls
  it, on contexts of length L: per drafted token one draft forward plus its logits processing. Calls of
  1 and ``DRAFT_K`` drafts give the cost per token (their difference) and per call (the rest). A fresh
  proposer's first call at the largest context gives its prefill (``setup_token_s``, once per request).
- **ngram, suffix.** Real ``propose`` calls on a context growing one token per call, each with the
  ``observe`` after it (suffix adds the committed tokens to its trees there, inside the engine's round).
  A fresh proposer's first call indexes the whole prompt (suffix: opening it builds the prompt's tree);
  its excess over a steady call at the largest context, per token, is ``setup_token_s``.
- **Overhead.** Plain greedy requests through the engine's own step loop; per round, ``RoundStats.overhead_s``
  (sampling, verification, commit), recovered from the cumulative stats each output carries.

:func:`self_check` then runs real requests (plain, ngram) and sets each round's measured time beside
``round_s``: a ratio near 1 says the model fits this machine at this moment.

torch and the proposers are imported inside the functions that run them: `specgate --help` builds the
parser, which shows the defaults defined here, and must stay instant.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams

DEFAULT_CONTEXTS = (32, 256, 1024, 2048)  # the workloads' prompts reach ~1700 tokens plus their output
DEFAULT_WIDTHS = (1, 2, 3, 5, 9, 17)  # k + 1 for k = 0, 1, 2, 4, 8, 16
DEFAULT_PREFILL_TOKENS = (16, 64, 256, 512)  # 256: the engine's prefill_chunk; 512: room to replay a larger
# one (replay refuses a --prefill-chunk beyond the grid); the others: a prompt's last chunk
DEFAULT_BATCHES = (1, 2, 4, 8, 16)  # sequences per step; up to the worker's --max-running-requests (16)
PROPOSERS = ("ngram", "suffix", "draft_model")
DRAFT_K = 8  # drafts per long timed draft_model call
MODEL_FREE_CALLS = 16  # steady-state calls per context for ngram and suffix
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=DRAFT_K + 1)
Progress = Callable[[str], None]
Measurements = dict  # the cost model file's fields (policies/costmodel.py), as plain data


def _median(values: Sequence[float]) -> float:
    return float(f"{statistics.median(values):.6g}")  # microseconds are noise at this scale


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def stream(token_ids: Sequence[int], length: int) -> list[int]:
    """``length`` ids: ``token_ids`` repeated as often as needed."""
    if not token_ids:
        raise ValueError("no token ids to calibrate with; give a real text's ids")
    return (list(token_ids) * (length // len(token_ids) + 1))[:length]


def _grids(runner, ids: list[int], contexts: Sequence[int], widths: Sequence[int],
           prefill_tokens: Sequence[int], repeats: int, chunk: int, progress: Progress) -> tuple[dict, dict]:
    samples: dict[tuple[str, int, int], list[float]] = {}
    prefill_contexts = sorted({0, *contexts})
    cache = runner.new_cache()
    for length in sorted({*contexts, *prefill_contexts}):
        have = runner.cache_len(cache)
        runner.prefill(cache, ids[have:length], chunk)  # grow the cache to this context with the text's ids
        jobs = [("forward", w) for w in widths] if length in contexts else []
        jobs += [("prefill", t) for t in prefill_tokens]
        for repeat in range(repeats + 1):  # pass 0 warms up
            for kind, tokens in jobs:
                keep = tokens if kind == "forward" else 1
                seconds = runner.forward(cache, ids[length:length + tokens], keep=keep).seconds
                runner.rollback(cache, length)
                if repeat:
                    samples.setdefault((kind, tokens, length), []).append(seconds)
        progress(f"forwards at context {length}: " + ", ".join(
            f"{kind} {tokens} {1e3 * _median(samples[kind, tokens, length]):.1f} ms" for kind, tokens in jobs))
    forward = dict(tokens=list(widths), context=list(contexts),
                   seconds=[[_median(samples["forward", w, c]) for c in contexts] for w in widths])
    prefill = dict(tokens=list(prefill_tokens), context=prefill_contexts,
                   seconds=[[_median(samples["prefill", t, c]) for c in prefill_contexts] for t in prefill_tokens])
    return forward, prefill


def _batched_grid(runner, ids: list[int], contexts: Sequence[int], widths: Sequence[int], batch: int,
                  repeats: int, chunk: int, progress: Progress) -> dict:
    """The forward grid of ``batch`` sequences per step: at every context each width fed by all of them in
    one ``forward_batch`` (what a step of ``batch`` rounds of that width runs), rolled back."""
    from backends.engine.runner import Feed  # pulls torch and transformers (about 6 s): see the module docstring

    samples: dict[tuple[int, int], list[float]] = {}
    caches = [runner.new_cache() for _ in range(batch)]
    for length in contexts:
        for cache in caches:
            runner.prefill(cache, ids[runner.cache_len(cache):length], chunk)
        for repeat in range(repeats + 1):  # pass 0 warms up
            for width in widths:
                fed = ids[length:length + width]
                seconds = runner.forward_batch([Feed(cache, fed, width) for cache in caches]).seconds
                for cache in caches:
                    runner.rollback(cache, length)
                if repeat:
                    samples.setdefault((width, length), []).append(seconds)
        progress(f"forwards of {batch} sequences at context {length}: " + ", ".join(
            f"{width} {1e3 * _median(samples[width, length]):.1f} ms" for width in widths))
    return dict(tokens=list(widths), context=list(contexts),
                seconds=[[_median(samples[w, c]) for c in contexts] for w in widths])


def _draft_model(runner, ids: list[int], contexts: Sequence[int], repeats: int, stop_ids: frozenset[int],
                 progress: Progress) -> dict:
    import torch  # about 2 s: see the module docstring

    from backends.engine.proposers.draft_model import DraftModelProposer  # see above

    proposer = DraftModelProposer(runner, stop_ids)
    generator = torch.Generator().manual_seed(0)
    lengths = sorted({max(1, c) for c in contexts})  # a committed context holds at least one token
    per_token, per_call = [], []
    for length in lengths:
        context = ids[:length]

        def propose(k: int) -> float:
            return _timed(lambda: proposer.propose(context, k, GREEDY, None, generator))

        propose(1)  # catches its cache up to this context (a prefill) and warms up
        propose(DRAFT_K)
        short, long = [], []
        for _ in range(repeats):
            short.append(propose(1))
            long.append(propose(DRAFT_K))
        one, many = _median(short), _median(long)
        token = (many - one) / (DRAFT_K - 1)
        if token <= 0:  # noise swamped the difference: charge the whole call per token
            token = many / DRAFT_K
        per_token.append(float(f"{token:.6g}"))
        per_call.append(one - token)
        progress(f"draft_model at context {length}: {1e3 * token:.2f} ms per token, {1e3 * (one - token):.2f} ms "
                 "per call")
    proposer.release()
    call_s = max(0.0, _median(per_call))
    fresh = DraftModelProposer(runner, stop_ids)  # a new request: its first call prefills the draft's cache
    context = ids[:lengths[-1]]
    first = _timed(lambda: fresh.propose(context, 1, GREEDY, None, generator))
    fresh.release()
    setup = max(0.0, first - call_s - per_token[-1]) / lengths[-1]
    progress(f"draft_model: a request's first call at context {lengths[-1]}: {1e3 * first:.1f} ms (its prefill)")
    return dict(call_s=call_s, context=lengths, token_s=per_token, setup_token_s=float(f"{setup:.6g}"))


def _model_free(name: str, open_proposer: Callable[[list[int]], object], ids: list[int],
                contexts: Sequence[int], progress: Progress) -> dict:
    import torch  # about 2 s: see the module docstring

    steady: list[float] = []
    first: dict[int, float] = {}
    generator = torch.Generator()
    for length in sorted({max(1, c) for c in contexts}):
        start = time.perf_counter()
        proposer = open_proposer(ids[:length])
        opened = time.perf_counter() - start

        def call(context: list[int]) -> float:
            def run() -> None:
                proposal = proposer.propose(context, DRAFT_K, GREEDY, None, generator)
                proposer.observe(len(proposal.tokens), 0, context)
            return _timed(run)

        first[length] = opened + call(ids[:length])
        steady.extend(call(ids[:length + i]) for i in range(1, MODEL_FREE_CALLS + 1))
        proposer.release()
    call_s = _median(steady)
    longest = max(first)
    setup = max(0.0, first[longest] - call_s) / longest
    progress(f"{name}: {1e6 * call_s:.1f} us per call; a request's first call, with indexing its prompt: "
             + ", ".join(f"{1e3 * s:.2f} ms at {n}" for n, s in first.items()))
    return dict(call_s=call_s, setup_token_s=float(f"{setup:.6g}"))


def seeded_suffix_store(engine, ids: list[int]):
    """A store of its own (the engine's scopes stay untouched), whose scope already holds a few responses,
    as a serving scope does."""
    from backends.engine.proposers.suffix import SuffixStore  # pulls torch (about 2 s): see the module docstring

    store = SuffixStore(engine.config.suffix)
    for j in range(16):
        text = ids[j * 96:(j + 1) * 96]
        proposer = store.open("calibrate", text[:32])
        proposer.observe(0, 0, text)  # its response enters the scope's global tree
        proposer.release()
    return store


@dataclass(frozen=True, slots=True)
class MeasuredRound:
    """One round of a real request, from the cumulative stats of the outputs around it."""

    context: int  # tokens cached before its target forward
    k: int  # drafts fed to the target
    draft_s: float
    verify_s: float
    overhead_s: float
    wall_s: float | None  # from the previous round's output to this one's (None for the first round)

    @property
    def seconds(self) -> float:
        """The round as RoundStats times it: draft + target forward + overhead."""
        return self.draft_s + self.verify_s + self.overhead_s


def run_rounds(engine, request: GenerateRequest) -> list[MeasuredRound]:
    """Serve ``request`` on an engine that is not started (stepped here) and return its rounds."""
    if getattr(engine, "_thread", None) is not None:
        raise ValueError("calibrate steps the engine itself; give an engine that is not started")
    marks: list[tuple[float, int, int, float, float, float, int, bool]] = []

    def on_output(out) -> None:
        s = out.stats  # the live object: copy what it holds now
        marks.append((time.perf_counter(), s.verify_ct, s.num_proposed_drafts, s.draft_s, s.verify_s,
                      s.overhead_s, len(out.output_ids), out.finished))

    engine.submit(request, on_output)
    while not (marks and marks[-1][-1]):
        engine.step()
    rounds = []
    before = (None, 0, 0, 0.0, 0.0, 0.0, 0, False)
    for mark in marks:
        if mark[1] == before[1] + 1:  # one round since the previous output
            rounds.append(MeasuredRound(
                context=len(request.input_ids) - 1 + before[6], k=mark[2] - before[2], draft_s=mark[3] - before[3],
                verify_s=mark[4] - before[4], overhead_s=mark[5] - before[5],
                wall_s=None if before[0] is None else mark[0] - before[0]))
        before = mark
    return rounds


def greedy_request(rid: str, prompt: list[int], max_new_tokens: int, proposer: str = "none", k: int = 4) -> GenerateRequest:
    speculation = SpeculationParams(proposer=proposer, draft_tokens=k) if proposer != "none" else SpeculationParams()
    return GenerateRequest(rid=rid, input_ids=tuple(prompt), speculation=speculation,
                           sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True))


def _overhead(engine, ids: list[int], contexts: Sequence[int], progress: Progress) -> float:
    rounds: list[MeasuredRound] = []
    for n, length in enumerate(sorted({max(2, c) for c in contexts})[:3]):
        rounds += run_rounds(engine, greedy_request(f"calibrate-overhead-{n}", ids[:length], 16))[1:]  # 1st: warm-up
    overhead = _median([r.overhead_s for r in rounds])
    progress(f"overhead: {1e3 * overhead:.3f} ms per round (median of {len(rounds)} plain rounds)")
    return overhead


def calibrate(engine, token_ids: Sequence[int], *, model: str, revision: str,
              contexts: Sequence[int] = DEFAULT_CONTEXTS, widths: Sequence[int] = DEFAULT_WIDTHS,
              prefill_tokens: Sequence[int] = DEFAULT_PREFILL_TOKENS, repeats: int = 5,
              proposers: Sequence[str] = PROPOSERS, draft_layers: int = 8, hardware: str = "",
              batches: Sequence[int] = DEFAULT_BATCHES, progress: Progress | None = None) -> Measurements:
    """Measure a cost model on ``engine`` (an ``Engine``, not started) with ``token_ids`` (a real text's ids,
    repeated as needed). ``model`` and ``revision`` name the target, as a trace header does. Returns the
    file's fields as plain data (``policies.costmodel.from_measurements`` makes the CostModel)."""
    from backends.engine.proposers.ngram import NgramProposer  # pulls torch (about 2 s): see the module docstring

    progress = progress or (lambda line: None)
    contexts, widths, prefill_tokens = sorted(set(contexts)), sorted(set(widths)), sorted(set(prefill_tokens))
    unknown = [p for p in proposers if p not in PROPOSERS]
    if unknown:
        raise ValueError(f"proposers: unknown {unknown}; choose from {list(PROPOSERS)}")
    batches = sorted({1, *batches})
    if repeats < 1 or not contexts or not widths or not prefill_tokens:
        raise ValueError("need repeats >= 1 and at least one context, width and prefill size")
    if batches[0] < 1:
        raise ValueError(f"batches: {batches[0]}; a step holds at least one sequence")
    runner = engine.runner
    longest = contexts[-1] + max(widths[-1], prefill_tokens[-1], DRAFT_K + 1, MODEL_FREE_CALLS + 1)
    if longest > runner.context_length:
        raise ValueError(f"context {contexts[-1]} plus {longest - contexts[-1]} tokens exceeds the model's context "
                         f"window ({runner.context_length}); use smaller contexts")
    ids = stream(token_ids, max(longest, 16 * 96))
    forward, prefill = _grids(runner, ids, contexts, widths, prefill_tokens, repeats, engine.config.prefill_chunk,
                              progress)
    grids = [forward] + [_batched_grid(runner, ids, contexts, widths, b, repeats, engine.config.prefill_chunk,
                                       progress) for b in batches[1:]]
    draft: dict[str, dict] = {}
    if "ngram" in proposers:
        draft["ngram"] = _model_free("ngram", lambda prompt: NgramProposer(), ids, contexts, progress)
    if "suffix" in proposers:
        store = seeded_suffix_store(engine, ids)
        draft["suffix"] = _model_free("suffix", lambda prompt: store.open("calibrate", prompt), ids, contexts,
                                      progress)
    if "draft_model" in proposers:
        draft_runner = runner.truncated(draft_layers)
        draft["draft_model"] = _draft_model(draft_runner, ids, contexts, repeats, frozenset(engine.eos_ids),
                                            progress)
    overhead_s = _overhead(engine, ids, contexts, progress)
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return dict(model=model, revision=revision, hardware=hardware, created=created,
                source="specgate trace calibrate", batch=batches, forward=grids, prefill=prefill, draft=draft,
                overhead_s=overhead_s)


@dataclass(frozen=True, slots=True)
class CheckArm:
    """Measured against predicted rounds of one real request (its first round left out: a warm-up)."""

    arm: str
    rounds: int
    measured_s: float  # median round as RoundStats times it
    wall_s: float  # median time from one round's output to the next
    predicted_s: float  # median round_s over the same rounds
    ratio: float  # median of predicted / measured, per round
    wall_ratio: float  # median of predicted / wall


def self_check(engine, round_s: Callable[[str, int, int], float], call_s: Mapping[str, float],
               token_ids: Sequence[int], *, prompt_tokens: int = 384, max_new_tokens: int = 32,
               k: int = 4, repeats: int = 3) -> list[CheckArm]:
    """Real rounds of plain and ngram (k drafts) requests on one prompt beside the model's
    ``round_s(proposer, k, context)``; ``call_s``: seconds per propose call of each proposer the model has.
    Each arm serves ``repeats`` requests, the arms alternating in ABBA order, so that load which comes and goes
    falls on both alike (one request each put the two arms 15% apart on a noisy machine, and not the next time)."""
    prompt = stream(token_ids, min(prompt_tokens, engine.runner.context_length - max_new_tokens - k - 1))
    arms = [("plain", "none")] + ([(f"ngram-k{k}", "ngram")] if "ngram" in call_s else [])
    served: dict[str, list[MeasuredRound]] = {arm: [] for arm, _ in arms}
    for repeat in range(repeats):
        for arm, proposer in (arms if repeat % 2 == 0 else arms[::-1]):
            request = greedy_request(f"calibrate-check-{arm}-{repeat}", prompt, max_new_tokens, proposer, k)
            served[arm] += run_rounds(engine, request)[1:]  # the first round: a warm-up
    out = []
    for arm, proposer in arms:
        rounds = served[arm]
        # a call that found nothing (k = 0) still cost a call: draft_s counts no call for k = 0
        missed = call_s[proposer] if proposer != "none" else 0.0
        predicted = [round_s(proposer, r.k, r.context) + (missed if r.k == 0 else 0.0) for r in rounds]
        walls = [(p, r.wall_s) for p, r in zip(predicted, rounds) if r.wall_s]
        out.append(CheckArm(
            arm=arm, rounds=len(rounds), measured_s=_median([r.seconds for r in rounds]),
            wall_s=_median([w for _, w in walls]), predicted_s=_median(predicted),
            ratio=_median([p / r.seconds for p, r in zip(predicted, rounds)]),
            wall_ratio=_median([p / w for p, w in walls])))
    return out


def default_text() -> str:
    """Real text when none is given: the source of Python's argparse module (~25k tokens of code, present
    wherever Python is). Forward times do not depend on which ids are fed; ngram and suffix calls do a little,
    so ``specgate trace calibrate --text`` takes a workload's text instead."""
    source = argparse.__file__ or ""
    if not source.endswith(".py"):
        raise ValueError("this Python ships no argparse.py source; give a text file with --text")
    with open(source, encoding="utf-8") as f:
        return f.read()


def describe_hardware(dtype: str) -> str:
    """What the numbers were measured on: CPU model, cores, torch threads and version, dtype."""
    import torch  # about 2 s: see the module docstring

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} thread(s), "
            f"{dtype}")
