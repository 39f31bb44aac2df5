"""The equivalence gate's run: canary prompts through a speculative pool and a plain reference.

Greedy (temperature 0): every canary's output token ids must be identical on both sides (exact speculative
decoding guarantees it; a lossy verification, a wrong draft-target pairing with a lossy acceptance rule, or a
target that is not the reference's shows up as the first differing position). Sampled (``SampledCheck``): per
output position, a chi-square test of homogeneity between the speculative and the plain tokens, Bonferroni
over positions. Both sides run through SGLang's own ``/v1/chat/completions`` with
``return_output_ids_in_sglext`` (the ids as the worker tokenized them, chat template included) and
``return_spec_tokens_details`` (the speculative side's accept length: the pair's canary baseline).

A worker that fails or a run past ``timeout_s`` gives an *error* verdict (not a verdict on the pair: the gate
stays pending and retries). The canaries: a JSON Lines file the policy names, or ``BUILTIN``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from backends.sglang.client import SGLangClient
from backends.sglang.errors import WorkerError
from backends.sglang.spec_stats import spec_stats_from_sglext
from gateway.gates.judge import homogeneity, sum_histograms
from gateway.gates.values import Mismatch, Verdict
from policies.schema import Equivalence, SampledCheck
from speculation import SpeculationOverride

T = TypeVar("T")


class Canary(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One canary: a ``prompt`` (sent as one user message) or chat ``messages``."""

    id: str
    slice: str = "default"
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None

    def chat(self) -> list[dict[str, Any]]:
        return self.messages if self.messages is not None else [{"role": "user", "content": self.prompt}]


_DOC = ("The committee met on Tuesday to review the budget. The committee agreed that the budget for the "
        "library would rise by four percent, that the budget for the parks would stay the same, and that the "
        "budget for the roads would be reviewed again in March. The committee also agreed that the minutes "
        "of the meeting would be published on the city website within a week.")

# One per slice kind: prompts whose answers copy from the prompt (where n-gram drafting accepts) and one that
# does not, short enough that the whole gate stays well inside its budget on a CPU worker.
BUILTIN: tuple[Canary, ...] = (
    Canary(id="builtin/code", slice="code", prompt=(
        "Rename the variable `total` to `running_sum` in this function and return the whole function:\n\n"
        "def add_all(values):\n    total = 0\n    for value in values:\n        total = total + value\n"
        "    return total\n")),
    Canary(id="builtin/tool_call", slice="tool_call", prompt=(
        'Answer with JSON only, in the form {"name": "get_weather", "arguments": {"city": "...", "unit": '
        '"celsius"}}, for this request: what is the weather in Paris in celsius?')),
    Canary(id="builtin/long_context", slice="long_context", prompt=(
        f"{_DOC}\n\nSummarize the meeting above in two sentences.")),
    Canary(id="builtin/prose", slice="prose", prompt="Write a short paragraph about why the sky is blue."),
)


class CanaryError(ValueError):
    """A canary file that cannot be used; the message names the file, the line and the field."""


def load_canaries(path: Path) -> list[Canary]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CanaryError(f"{path}: cannot read the canary file ({exc.strerror}); fix gates.equivalence."
                          "canaries") from None
    out: list[Canary] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            canary = msgspec.json.decode(line, type=Canary)
        except msgspec.ValidationError as exc:
            raise CanaryError(f"{path}:{number}: {exc}; each line is {{\"id\", \"slice\", \"prompt\" or "
                              "\"messages\"}") from None
        except msgspec.DecodeError as exc:
            raise CanaryError(f"{path}:{number}: not JSON ({exc}); one JSON object per line") from None
        if (canary.prompt is None) == (canary.messages is None):
            raise CanaryError(f"{path}:{number}: give exactly one of `prompt` or `messages`")
        if canary.id in seen:
            raise CanaryError(f"{path}:{number}: `id` {canary.id!r} repeats an earlier line; ids must be unique")
        seen.add(canary.id)
        out.append(canary)
    if not out:
        raise CanaryError(f"{path}: no canaries; add at least one line")
    return out


def pick(canaries: Sequence[Canary], settings: Equivalence) -> list[Canary]:
    """``per_slice`` canaries of each slice, in file order, at most ``max_canaries`` in all."""
    per: Counter[str] = Counter()
    out = []
    for canary in canaries:
        if per[canary.slice] < settings.per_slice and len(out) < settings.max_canaries:
            per[canary.slice] += 1
            out.append(canary)
    return out


class Side(msgspec.Struct, frozen=True, kw_only=True):
    """Where one side of the comparison runs: a worker, the model name it serves, and the
    ``custom_params.speculation`` to send (None: the worker's own configuration)."""

    client: SGLangClient
    model: str
    speculation: SpeculationOverride | None = None


class _Answer(msgspec.Struct, frozen=True):
    ids: list[int]
    verify_ct: int
    correct: int
    histogram: tuple[int, ...]


async def _ask(side: Side, canary: Canary, max_tokens: int, temperature: float, seed: int | None) -> _Answer:
    body: dict[str, Any] = {"model": side.model, "messages": canary.chat(), "max_tokens": max_tokens,
                            "temperature": temperature, "return_output_ids_in_sglext": True}
    if seed is not None:
        body["seed"] = seed
    if side.speculation is not None:
        body["custom_params"] = {"speculation": msgspec.to_builtins(side.speculation)}
    result = await side.client.chat_completions(body)
    ext = result.parsed.sglext
    if ext is None or not ext.output_ids:
        raise WorkerError(side.client.base_url, "the worker returned no output ids (it needs SGLang's "
                          "return_output_ids_in_sglext, 0.5.23 or later)")
    stats = spec_stats_from_sglext(ext)
    return _Answer(list(ext.output_ids[0]), stats.verify_ct if stats else 0,
                   (stats.num_correct_drafts or 0) if stats else 0, (stats.histogram or ()) if stats else ())


def first_difference(spec: list[int], plain: list[int]) -> tuple[int, int | None, int | None] | None:
    """(position, speculative token, plain token) where the two outputs first differ, or None."""
    for i, (a, b) in enumerate(zip(spec, plain)):
        if a != b:
            return i, a, b
    if len(spec) != len(plain):
        i = min(len(spec), len(plain))
        return i, spec[i] if i < len(spec) else None, plain[i] if i < len(plain) else None
    return None


async def run(spec: Side, plain: Side, canaries: Sequence[Canary], settings: Equivalence) -> Verdict:
    """One run of the gate: a verdict, or an error verdict when it could not finish within ``timeout_s``."""
    t0 = time.monotonic()
    try:
        return await asyncio.wait_for(_run(spec, plain, canaries, settings, t0), settings.timeout_s)
    except TimeoutError:
        return Verdict(passed=False, error=True, reason=f"the run took longer than timeout_s = "
                       f"{settings.timeout_s:g} s", seconds=time.monotonic() - t0, worker=spec.client.base_url)
    except WorkerError as exc:
        return Verdict(passed=False, error=True, reason=f"a canary request failed: {exc}",
                       seconds=time.monotonic() - t0, worker=spec.client.base_url)


async def _run(spec: Side, plain: Side, canaries: Sequence[Canary], settings: Equivalence, t0: float) -> Verdict:
    limit = asyncio.Semaphore(settings.concurrency)

    async def bounded(side: Side, canary: Canary, n: int, temperature: float, seed: int | None) -> _Answer:
        async with limit:
            return await _ask(side, canary, n, temperature, seed)

    greedy = [(c, c.max_tokens or settings.max_tokens) for c in canaries]
    answers = await _all(bounded(side, c, n, 0.0, None) for c, n in greedy for side in (spec, plain))
    rounds = sum(a.verify_ct for a in answers[::2])
    correct = sum(a.correct for a in answers[::2])
    histogram = sum_histograms(a.histogram for a in answers[::2])
    tokens = 0
    for i, (canary, _) in enumerate(greedy):
        mine, ref = answers[2 * i], answers[2 * i + 1]
        tokens += len(ref.ids)
        diff = first_difference(mine.ids, ref.ids)
        if diff is not None:
            position, a, b = diff
            return Verdict(
                passed=False, canaries=len(greedy), tokens=tokens, seconds=time.monotonic() - t0,
                worker=spec.client.base_url, mismatch=Mismatch(canary=canary.id, position=position,
                                                               speculative=a, plain=b),
                reason=f"greedy output differs from plain on canary {canary.id!r} at output position {position}: "
                       f"speculative token {a}, plain token {b}")
    accept = (rounds + correct) / rounds if rounds else None
    sampled_p, positions = None, 0
    if settings.sampled is not None:
        sampled_p, positions = await _sampled(spec, plain, canaries, settings.sampled, bounded)
        check = settings.sampled
        if sampled_p is not None and sampled_p < check.alpha / max(1, positions):
            return Verdict(
                passed=False, canaries=len(greedy), tokens=tokens, sampled_p=sampled_p, sampled_positions=positions,
                accept_length=accept, histogram=histogram, seconds=time.monotonic() - t0,
                worker=spec.client.base_url,
                reason=f"sampled outputs (temperature {check.temperature:g}, {check.samples} per side) are not "
                       f"distributed as plain's: chi-square p = {sampled_p:.2g} at some position < alpha "
                       f"{check.alpha:g} / {positions} positions")
    al = f", canaries accept {accept:.2f} per round" if accept is not None else ""
    sampled = (f"; sampled check p_min = {sampled_p:.2g} over {positions} positions" if sampled_p is not None
               else "")
    return Verdict(passed=True, canaries=len(greedy), tokens=tokens, sampled_p=sampled_p, sampled_positions=positions,
                   accept_length=accept, histogram=histogram, seconds=time.monotonic() - t0,
                   worker=spec.client.base_url,
                   reason=f"{len(greedy)} canaries token-identical to plain ({tokens} tokens){al}{sampled}")


async def _sampled(spec: Side, plain: Side, canaries: Sequence[Canary], check: SampledCheck, bounded: Any
                   ) -> tuple[float | None, int]:
    smallest, positions = None, 0
    for canary in list(canaries)[:check.prompts]:
        seeds = range(check.seed, check.seed + check.samples)
        mine = gather_ids(bounded(spec, canary, check.max_tokens, check.temperature, s) for s in seeds)
        ref = gather_ids(bounded(plain, canary, check.max_tokens, check.temperature, s + check.samples)
                         for s in seeds)
        a, b = await _all((mine, ref))
        p, tested = homogeneity(a, b)
        positions += tested
        if p is not None:
            smallest = p if smallest is None else min(smallest, p)
    return smallest, positions


async def gather_ids(calls: Any) -> list[list[int]]:
    return [answer.ids for answer in await _all(calls)]


async def _all(calls: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Every call's result, in order; when one fails the others are cancelled (``asyncio.TaskGroup``: a run
    that gave up leaves no canary request running on the worker) and its exception is raised as itself."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call) for call in calls]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]
