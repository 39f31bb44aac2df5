"""`specgate trace build`: run requests once, plain greedy, on the embedded engine and write their trace.

Each request is an OpenAI chat body (what a gateway receives, and what ops keep), given as a JSON Lines file
of :class:`RequestLine` or drawn from the workloads (``replay/workloads.py``). It is served as the
embedded worker would serve it with ``temperature: 0`` and ``max_tokens`` capped: the worker's own
translation (``backends/worker/translate.chat_request``: chat template, tools, sampling checks) gives the
prompt ids, the policy's own ``features_from_openai`` the features. Requests run one after another, so a
built trace's arrival times are its own sequential submissions (a replay chooses its load instead).

For every draft pair of kind ``layer_truncated`` the trace names, one teacher-forced pass of that draft
(``backends/engine/counterfactual.draft_matches``) stores its per-token match flags, from which replay
gets the draft model's rounds for any k. Model-free proposers (ngram, suffix) need nothing stored.
The file is written by ``policies.trace.write_trace``: 0600, whole or not at all; nothing here prints or
logs a token id or a prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from backends.engine.model_store import tokenizer_digest
from backends.engine.types import SpeculationParams
from backends.sglang import openai_wire
from backends.worker.errors import BadRequest
from backends.worker.translate import Limits, chat_request
from policies.features import features_from_openai
from policies.schema import DraftId, ModelId, Pair, Policy, pair_version
from policies.trace import FORMAT, Header, Sampling, Served, TraceRequest, write_trace
from replay.workloads import SLICES, sample

SOURCE = "specgate trace build"


class RequestLine(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One line of a ``--requests`` file: an OpenAI chat/completions body, the route it arrived on and
    the slice label of its source (free text, kept in the trace; "" when unknown)."""

    id: str
    body: dict[str, Any]
    route: str = "default"
    slice: str = ""


class BuildError(ValueError):
    """A request file, pair or request that cannot be traced; the message names the line or request."""


def read_requests(path: str | Path) -> list[RequestLine]:
    """A ``--requests`` file, strictly: an unknown key or a wrong type names its line and field."""
    path = Path(path)
    decoder = msgspec.json.Decoder(RequestLine)
    lines, seen = [], {}
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = decoder.decode(line)
            except msgspec.ValidationError as exc:
                raise BuildError(f"{path}:{number}: {exc}") from None
            except msgspec.DecodeError as exc:
                raise BuildError(f"{path}:{number}: malformed JSON ({exc})") from None
            if item.id in seen:
                raise BuildError(f"{path}:{number}: id {item.id!r} already on line {seen[item.id]}")
            seen[item.id] = number
            lines.append(item)
    if not lines:
        raise BuildError(f"{path}: no requests")
    return lines


def workload_requests(root: str | Path | None, per_slice: int, seed: int = 0, max_chars: int = 6000,
                      slices: Sequence[str] | None = None, route: str = "default") -> list[RequestLine]:
    """The seeded per-slice sample of the workloads under ``root`` (``None``: the default directory;
    ``replay.workloads.sample``, the benchmarks' draw) as chat requests; BFCL items carry their ``tools``."""
    items = sample(root, per_slice, seed, max_chars, tuple(slices or SLICES))
    return [RequestLine(id=item.id, route=route, slice=item.slice, body=item.chat_body()) for item in items]


def self_draft_pair(model: str, revision: str, layers: int) -> Pair:
    """The embedded worker's self-draft as a policy pair (the same version a policy's
    ``draft: {kind: layer_truncated, layers: N}`` pair on this target has)."""
    return Pair(target=ModelId(model=model, revision=revision), draft=DraftId(kind="layer_truncated", layers=layers))


def policy_pairs(policy: Policy, revision: str) -> dict[str, Pair]:
    """The draft pairs of a policy that need a teacher-forced pass: pair version -> pair. ngram and suffix
    pairs need none; a pair on another target revision, or a separate draft model, is an error."""
    pairs: dict[str, Pair] = {}
    for name, pair in policy.pairs.items():
        kind = pair.draft.kind
        if kind in ("ngram", "suffix"):
            continue
        if kind != "layer_truncated":
            raise BuildError(f"pair {name}: draft kind {kind} has no teacher-forced pass yet (only layer_truncated "
                             "self-drafts of the embedded model)")
        if pair.target.revision not in (None, revision):
            raise BuildError(f"pair {name}: target revision {pair.target.revision}, but the embedded model is "
                             f"{revision}; trace the model the pair names")
        pairs[pair_version(pair)] = pair
    return pairs


@dataclass
class BuildSummary:
    requests: int = 0
    output_tokens: int = 0
    matched: dict[str, int] | None = None  # pair version -> output positions whose draft argmax matched

    def describe(self, pairs: dict[str, Pair]) -> str:
        lines = [f"{self.requests} requests, {self.output_tokens} output tokens"]
        for version, count in (self.matched or {}).items():
            share = count / self.output_tokens if self.output_tokens else 0.0
            lines.append(f"  pair {version} ({pairs[version].draft.kind}, {pairs[version].draft.layers} layers): "
                         f"draft argmax = committed token at {count} of {self.output_tokens} positions ({share:.1%})")
        return "\n".join(lines)


def build(engine: Any, requests: Iterable[RequestLine], out: str | Path, *, model: str, revision: str,
          max_new_tokens: int, pairs: dict[str, Pair], clock: Callable[[], float] = time.perf_counter,
          ) -> BuildSummary:
    """Serve every request once on ``engine`` (a backends.engine.Engine, stepped here: not started) and
    write the trace to ``out``. A request the worker would refuse stops the build (nothing is written)."""
    header = Header(format=FORMAT, model=model, revision=revision, tokenizer=tokenizer_digest(engine.tokenizer),
                    pairs=dict(pairs), created=datetime.now(UTC).isoformat(timespec="seconds"), source=SOURCE)
    summary = BuildSummary(matched={version: 0 for version in pairs})
    write_trace(out, header, _traced(engine, requests, max_new_tokens, pairs, clock, summary))
    return summary


def _traced(engine: Any, requests: Iterable[RequestLine], max_new_tokens: int, pairs: dict[str, Pair],
            clock: Callable[[], float], summary: BuildSummary) -> Iterator[TraceRequest]:
    from backends.engine.counterfactual import draft_matches  # pulls torch (about 2 s): only a build needs it

    drafts = {version: engine.runner.truncated(pair.draft.layers)
              for version, pair in pairs.items()}
    limits = Limits(context_length=engine.context_length, default_speculation=SpeculationParams())
    start = clock()
    for line in requests:
        body = served_body(line.body, max_new_tokens)
        try:
            request = chat_request(msgspec.convert(body, openai_wire.ChatCompletionRequest), engine.tokenizer, limits)
        except (BadRequest, msgspec.ValidationError) as exc:
            raise BuildError(f"request {line.id!r}: the worker would refuse it: {exc}") from None
        request = replace(request, rid=f"trace-{summary.requests}", speculation=SpeculationParams())
        arrival = clock() - start
        out = engine.generate(request)
        stats, output = out.stats, list(out.output_ids)
        if out.finish_reason is None or out.finish_reason.type == "abort":
            reason = out.finish_reason.message if out.finish_reason else "no finish reason"
            raise BuildError(f"request {line.id!r}: the engine aborted it ({reason})")
        sampling = request.sampling
        stops = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else engine.eos_ids)
        flags = {}
        for version, runner in drafts.items():
            matches = draft_matches(runner, request.input_ids, output, sampling, stops).matches
            flags[version] = "".join("1" if m else "0" for m in matches)
            summary.matched[version] += sum(matches)  # type: ignore[index]
        summary.requests += 1
        summary.output_tokens += len(output)
        yield TraceRequest(
            id=line.id, arrival_s=arrival, route=line.route, slice=line.slice,
            features=features_from_openai(body, route=line.route),
            sampling=Sampling(temperature=sampling.temperature, max_new_tokens=sampling.max_new_tokens),
            served=Served(proposer="none", draft_tokens=0, rounds=[(0, 0)] * stats.verify_ct,
                          finish=out.finish_reason.type, ttft_s=stats.first_token_s, e2e_s=stats.e2e_s),
            draft_matches=flags, prompt_ids=list(request.input_ids), output_ids=output)


def served_body(body: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    """The body as traced: greedy, ``max_tokens`` capped at ``max_new_tokens``, no speculation override
    (plain decoding), not streamed."""
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    limit = max_new_tokens if asked is None else min(int(asked), max_new_tokens)
    served = {k: v for k, v in body.items() if k not in ("max_completion_tokens", "custom_params", "stream",
                                                         "stream_options")}
    return {**served, "temperature": 0.0, "max_tokens": limit}


def from_trace(requests: Iterable[TraceRequest], pair: str | None = None,
               ) -> tuple[list, list[tuple[bool, ...]] | None]:
    """Trace records as replay input (backends/engine/counterfactual.py): a Recorded per request (its suffix scope is its
    route, as the gateway scopes suffix pools) and, with ``pair`` (a pair version in the trace's header),
    each request's draft match flags. Only greedy requests have an exact counterfactual."""
    from backends.engine.counterfactual import Recorded  # torch: imported when replay input is built

    records: list[Recorded] = []
    matches: list[tuple[bool, ...]] | None = [] if pair is not None else None
    for request in requests:
        if not request.sampling.greedy:
            raise ValueError(f"request {request.id!r}: temperature {request.sampling.temperature} has no exact "
                             "counterfactual (greedy requests only)")
        records.append(Recorded(prompt=tuple(request.prompt_ids), output=tuple(request.output_ids),
                                max_new_tokens=request.sampling.max_new_tokens, scope=request.route))
        if matches is not None:
            flags = request.draft_matches.get(pair)  # type: ignore[arg-type]
            if flags is None:
                raise ValueError(f"request {request.id!r}: no draft_matches for pair {pair}")
            matches.append(tuple(flag == "1" for flag in flags))
    return records, matches
