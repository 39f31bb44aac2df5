"""The trace format: served requests recorded for exact replay (docs/replay.md).

A trace is JSON Lines. Line 1 is a :class:`Header` (``"kind": "header"``): the format version, the target
model and its weight revision, the tokenizer's digest, and the draft pairs whose teacher-forced match flags
the records carry. Every later line is one :class:`TraceRequest` (``"kind": "request"``): when it arrived,
its route and slice, the features the policy read, its sampling parameters, its prompt and output token
ids, what served it, and per draft pair the flags from which any draft length's rounds follow.

Token ids are user content: :func:`write_trace` creates the file 0600 and writes it whole or not at all
(a temporary file beside it, renamed at the end), and nothing here logs a record. Reading is strict, like
the policy file: an unknown field, a wrong type, a truncated line or a trace of another model revision is
an error naming the file, the line and the field (:class:`TraceError`).

Pure (msgspec only): ``policies`` imports no torch, so the gateway's recorder, ``specgate trace build`` and
the replay simulator all read and write this one format.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from policies.features import RequestFeatures
from policies.schema import Pair, pair_version

FORMAT = 1
TokenId = Annotated[int, Meta(ge=0)]
PairVersion = Annotated[str, Meta(pattern=r"^[0-9a-f]{12}$", description="12 hex digits (policies.schema)")]
MatchFlags = Annotated[str, Meta(pattern=r"^[01]*$", description="one '0' or '1' per output token")]
Seconds = Annotated[float, Meta(ge=0)]
Round = tuple[Annotated[int, Meta(ge=0)], Annotated[int, Meta(ge=0)]]  # (drafted, accepted)


class _Line(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, tag_field="kind"):
    """Base of a trace line: strict, and tagged by ``kind`` so a line says what it is."""


class Header(_Line, tag="header", kw_only=True):
    """What every record of the trace depends on. ``revision`` is the target weights' sha256 (``specgate
    model info``): output ids are a function of it, so a trace replays only on the same revision.
    ``tokenizer``: sha256 over the tokenizer and its chat template (prompt ids depend on both). ``pairs``:
    pair version -> pair identity, for each draft whose match flags the records carry."""

    format: Literal[1]
    model: str
    revision: str
    tokenizer: str
    pairs: dict[PairVersion, Pair] = {}
    created: str = ""  # ISO 8601, UTC
    source: str = ""  # what wrote it: "specgate trace build", later the gateway's recorder

    def __post_init__(self) -> None:
        for version, pair in self.pairs.items():
            if pair_version(pair) != version:
                raise ValueError(f"field pairs.{version}: the pair listed has version {pair_version(pair)}")
            if pair.target.revision not in (None, self.revision):
                raise ValueError(f"field pairs.{version}.target.revision: {pair.target.revision}, but the "
                                 f"trace's target is {self.revision}")


class Sampling(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The sampling parameters that decide the output and how many drafts a round may take."""

    temperature: Annotated[float, Meta(ge=0)]
    max_new_tokens: Annotated[int, Meta(ge=1)]

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6  # SGLang's rule, as backends/engine/types.SamplingParams


class Served(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What served the request. ``pool`` and ``rule``: the policy's decision ("" outside a gateway);
    ``draft_tokens``: k (0 with proposer none). ``rounds``: (drafted, accepted) per target forward, in
    order; None when the server reported only totals. Timings are seconds from arrival, None if unknown."""

    pool: str = ""
    rule: str = ""
    proposer: str
    draft_tokens: Annotated[int, Meta(ge=0)]
    rounds: list[Round] | None = None
    finish: Literal["stop", "length", "abort"]
    ttft_s: Seconds | None = None
    e2e_s: Seconds | None = None


class TraceRequest(_Line, tag="request", kw_only=True):
    """One served request. ``slice`` is the label of the request's source (a workload's slice), not the
    policy's: replay derives the policy's slice from ``features``. ``draft_matches``: pair version -> one
    flag per output token, '1' where the draft's greedy argmax after ``prompt_ids + output_ids[:i]`` is
    ``output_ids[i]`` (backends/engine/counterfactual.draft_matches)."""

    id: str
    arrival_s: Seconds  # from the start of the trace
    route: str
    slice: str = ""
    features: RequestFeatures
    sampling: Sampling
    served: Served
    draft_matches: dict[PairVersion, MatchFlags] = {}
    prompt_ids: list[TokenId]
    output_ids: list[TokenId]

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("field prompt_ids: empty")
        if len(self.output_ids) > self.sampling.max_new_tokens:
            raise ValueError(f"field output_ids: {len(self.output_ids)} tokens, over sampling.max_new_tokens "
                             f"{self.sampling.max_new_tokens}")
        for version, flags in self.draft_matches.items():
            if len(flags) != len(self.output_ids):
                raise ValueError(f"field draft_matches.{version}: {len(flags)} flags for "
                                 f"{len(self.output_ids)} output tokens")
        rounds = self.served.rounds
        if rounds is None:
            return
        for n, (drafted, accepted) in enumerate(rounds):
            if accepted > drafted:
                raise ValueError(f"field served.rounds[{n}]: accepted {accepted} > drafted {drafted}")
        # every round but the last commits accepted + 1 tokens; the last at least one (a stop may cut it)
        before = sum(accepted + 1 for _, accepted in rounds[:-1])
        if self.output_ids and not before < len(self.output_ids) <= before + rounds[-1][1] + 1 \
                or not self.output_ids and rounds:
            raise ValueError(f"field served.rounds: {len(rounds)} rounds cannot commit {len(self.output_ids)} "
                             "tokens")


class TraceError(ValueError):
    """A trace that cannot be read: ``FILE:LINE: field PATH: what is wrong``."""


@dataclass(frozen=True, slots=True)
class Trace:
    header: Header
    requests: list[TraceRequest]


_DECODER = msgspec.json.Decoder(Header | TraceRequest)
_ENCODER = msgspec.json.Encoder()
_AT = re.compile(r"^(?P<what>.*) - at `(?:key` in `)?\$\.?(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]+)`")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]+)`")


def _explain(error: msgspec.ValidationError, unknown: str = f"unknown field (trace format {FORMAT})") -> str:
    """msgspec's "Expected `int`, got `str` - at `$.served.rounds[0][1]`" as "field served.rounds[0][1]:
    expected `int`, got `str`". ``__post_init__`` messages already start with their field, relative to their
    Struct: a nested one's path is put in front. ``unknown``: what an unknown field is called (the cost model
    file, policies/costmodel.py, reuses this with its own format)."""
    text = str(error)
    path, what = "", text
    if match := _AT.match(text):
        path, what = match["path"], match["what"]
    if match := _UNKNOWN.match(what) or _MISSING.match(what):
        name = f"{path}.{match['name']}" if path else match["name"]
        problem = unknown if match.re is _UNKNOWN else "missing (a required field)"
        return f"field {name}: {problem}"
    if what.startswith("field "):
        inner = what.removeprefix("field ")
        return f"field {path}{'' if inner.startswith('[') else '.'}{inner}" if path else what
    if path:
        return f"field {path}: {what[0].lower()}{what[1:]}"
    return what


def read_trace(path: str | Path, *, revision: str | None = None, growing: bool = False) -> Trace:
    """Read and check a whole trace. ``revision``: the target weights replay will use; a trace recorded on
    another revision is refused (its output ids would not be this model's). ``growing``: the file is being
    appended to (the gateway's current recording): a last line without its newline is a record being
    written, left out instead of refused."""
    path = Path(path)
    with path.open("rb") as f:
        data = f.read()
    if not data:
        raise TraceError(f"{path}: empty; a trace starts with its header line")
    lines = data.split(b"\n")
    if lines[-1] and growing and len(lines) > 1:
        lines[-1] = b""
    if lines[-1]:
        raise TraceError(f"{path}:{len(lines)}: truncated: the last line has no newline (the writer stopped "
                         "mid-line); rebuild the trace or drop that line")
    header: Header | None = None
    requests: list[TraceRequest] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines[:-1], 1):
        where = f"{path}:{number}"
        if not line.strip():
            raise TraceError(f"{where}: empty line")
        try:
            item = _DECODER.decode(line)
        except msgspec.ValidationError as exc:
            raise TraceError(f"{where}: {_explain(exc)}") from None
        except msgspec.DecodeError as exc:
            raise TraceError(f"{where}: malformed JSON ({exc})") from None
        if isinstance(item, Header):
            if header is not None:
                raise TraceError(f"{where}: field kind: a second header (the header is line 1 only)")
            header = item
            if revision is not None and item.revision != revision:
                raise TraceError(f"{where}: field revision: the trace was recorded on model revision "
                                 f"{item.revision}, this model is {revision}; build a trace with this model "
                                 "(specgate trace build)")
            continue
        if header is None:
            raise TraceError(f"{where}: field kind: expected the header line first, got a request")
        if item.id in first_line:
            raise TraceError(f"{where}: field id: request id {item.id!r} already on line {first_line[item.id]}")
        first_line[item.id] = number
        unknown = sorted(set(item.draft_matches) - set(header.pairs))
        if unknown:
            raise TraceError(f"{where}: field draft_matches.{unknown[0]}: pair version not in the header's pairs")
        requests.append(item)
    if header is None:  # unreachable (a non-empty file has a line 1), kept for the type checker
        raise TraceError(f"{path}: no header line")
    return Trace(header, requests)


def encode_line(item: Header | TraceRequest) -> bytes:
    return _ENCODER.encode(item) + b"\n"


def write_trace(path: str | Path, header: Header, requests: Iterable[TraceRequest]) -> int:
    """Write a whole trace: a 0600 temporary file beside ``path``, renamed over it once every line is
    written (a failure leaves no partial trace). ``requests`` may be a generator that runs the model.
    Returns the number of requests written."""
    path = Path(path)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent or ".")
    written = 0
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(encode_line(header))
            for request in requests:
                f.write(encode_line(request))
                written += 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return written
