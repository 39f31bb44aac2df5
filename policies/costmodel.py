"""The replay cost model: seconds of every step a simulated engine takes (docs/replay.md).

Replay knows exactly which forwards a policy would have run (the counterfactuals); only their time needs a
model. A forward's time depends on what it holds, so the model is a table of measurements, never a formula
fitted to a guess: per batch size a :class:`Grid` of seconds by tokens fed per sequence (1 for a plain
step, k + 1 for a verify round) and context length (tokens cached before the forward); a grid for prefill
chunks; per proposer the draft's cost (a fixed cost per call, plus a cost per drafted token that may grow
with the context, as a draft model's does); and the per-round overhead outside both (sampling, verification,
commit). A round of proposer P with k drafts at context L costs ``draft_s(P, k, L) + forward_s(k + 1, L) +
overhead_s``.

One file per pool: ``specgate trace calibrate`` measures the embedded engine; a pool on GPUs gets a file
filled from SGLang's ``bench_one_batch`` (docs/replay.md says how). A running specgate worker's live step
costs make a coarser one (``policies.live_costs.from_server_info``: one context length). Between measured points values are
interpolated linearly; outside them a cost only grows (see :meth:`Grid.at`), so replay never predicts a
forward cheaper than one that was measured next to it. ``revision`` ties the file to the target weights it
was measured on, as a trace header does.

Pure (msgspec and the stdlib): the simulator runs the gateway's policy code, which imports no torch.
Errors name the file and the field and say what to do, like the trace and policy files (:class:`CostModelError`).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from bisect import bisect_right
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from policies.measured import centered_fit, line
from policies.trace import _explain

FORMAT = 1
_UNKNOWN_FIELD = f"unknown field (cost model format {FORMAT})"


def _ascending(name: str, values: Sequence[float], least: float, what: str) -> None:
    if not values:
        raise ValueError(f"field {name}: empty; give at least one {what}")
    for i, value in enumerate(values):
        if value < least:
            raise ValueError(f"field {name}[{i}]: {value}; {what} must be >= {least}")
        if i and value <= values[i - 1]:
            raise ValueError(f"field {name}[{i}]: {value} after {values[i - 1]}; list {what} in ascending "
                             "order, each once")


def _seconds(name: str, value: float, *, zero: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"field {name}: {value}; seconds must be finite and {bound} (remeasure it)")


class Grid(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, dict=True):
    """Measured seconds of one forward by tokens fed per sequence and context length before it.
    ``seconds[i][j]`` is the forward feeding ``tokens[i]`` tokens after ``context[j]`` cached ones, as measured
    (what a file holds); it is read through ``fitted``, the centred non-decreasing fit in tokens at each context
    (``policies.measured.centered_fit``), as the engine reads its own table (``backends.engine.step_costs``): a
    noisy point never prices a wider forward at or below a narrower one, which the per-round rule would chase. The
    fit is not kept in ``seconds``: the centred fit of a fit is not the fit (a flat first run of three or more
    counts is read again as rising), so a model written and read again would have moved."""

    tokens: list[int]  # ascending, >= 1
    context: list[int]  # ascending, >= 0
    seconds: list[list[float]]  # [len(tokens)][len(context)], > 0

    def __post_init__(self) -> None:
        _ascending("tokens", self.tokens, 1, "tokens fed per sequence")
        _ascending("context", self.context, 0, "context lengths")
        if len(self.seconds) != len(self.tokens):
            raise ValueError(f"field seconds: {len(self.seconds)} rows for {len(self.tokens)} tokens; give one "
                             "row per entry of tokens")
        for i, row in enumerate(self.seconds):
            if len(row) != len(self.context):
                raise ValueError(f"field seconds[{i}]: {len(row)} values for {len(self.context)} contexts; give "
                                 "one value per entry of context")
            for j, value in enumerate(row):
                _seconds(f"seconds[{i}][{j}]", value)
        fitted = zip(*(centered_fit(self.tokens, [row[j] for row in self.seconds]) for j in range(len(self.context))))
        self.__dict__["fitted"] = [list(row) for row in fitted]  # not a field: never encoded, never compared

    def at(self, tokens: float, context: float) -> float:
        """Seconds at (tokens, context). Bilinear inside the grid: along ``context`` in every row, then along
        ``tokens``. Outside it, per axis, linear extrapolation from the two nearest points when that rises
        away from the grid, else the nearest point's value: never below the value measured at the nearest
        point (a shorter context or a narrower forward than any measured costs what the nearest measured
        one did; a longer or wider one grows with the end segment's slope)."""
        tokens_at, rows = self.tokens, self.fitted
        if len(tokens_at) == 1:
            return line(self.context, rows[0], context)
        i = min(max(bisect_right(tokens_at, tokens) - 1, 0), len(tokens_at) - 2)  # the rows line would read
        pair = (line(self.context, rows[i], context), line(self.context, rows[i + 1], context))
        return line(tokens_at[i:i + 2], pair, tokens)


class DraftCost(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A proposer's cost for one propose call drafting k tokens at context L: ``call_s + k * token(L)``.
    Model-free proposers (ngram, suffix) have only ``call_s``; a draft model runs one forward per drafted
    token, whose cost grows with the context: ``token_s`` per entry of ``context`` (interpolated linearly,
    clamped at the ends), or one value for any context when ``context`` is empty.

    ``setup_token_s``: seconds per prompt token, once per request: what the proposer spends on the prompt
    before its first draft (ngram indexes it, suffix builds its prompt tree, a draft model prefills its own
    cache in one forward: on this CPU that is seconds for a long prompt, all of it in the request's TTFT)."""

    call_s: float = 0.0
    context: list[int] = []
    token_s: list[float] = []
    setup_token_s: float = 0.0

    def __post_init__(self) -> None:
        _seconds("call_s", self.call_s, zero=True)
        _seconds("setup_token_s", self.setup_token_s, zero=True)
        if self.context:
            _ascending("context", self.context, 0, "context lengths")
            if len(self.token_s) != len(self.context):
                raise ValueError(f"field token_s: {len(self.token_s)} values for {len(self.context)} contexts; "
                                 "give one value per entry of context")
        elif len(self.token_s) > 1:
            raise ValueError(f"field token_s: {len(self.token_s)} values without context; give one value, or "
                             "the contexts they were measured at")
        for i, value in enumerate(self.token_s):
            _seconds(f"token_s[{i}]", value, zero=True)

    def token(self, context: float) -> float:
        if not self.token_s:
            return 0.0
        if not self.context:
            return self.token_s[0]
        clamped = min(max(context, self.context[0]), self.context[-1])
        return line(self.context, self.token_s, clamped)


class CostModel(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Seconds of every step of one pool's engine. ``forward[b]`` is the target forward (plain step or
    verify) with ``batch[b]`` sequences, each at the grid's tokens and context; ``prefill`` one prefill
    chunk of one sequence; ``draft`` per proposer; ``overhead_s`` per round, outside draft and forward.
    ``serving_s``: what each round costs on top when its tokens stream through the HTTP stack on the same
    machine (the worker's HTTP thread, the gateway, the client): not in the engine's own rounds (``round_s``
    and calibrate's self-check leave it out), measured by serving: on 2 CPU cores ~29 ms per round, fitted on
    plain decoding at c1 (``bench/replay_fidelity.py --fit-serving``, docs/replay.md); 0 where the serving
    path runs on other cores than the model (a GPU pool). ``serving_concurrent_s``: the same per round when the
    step streams two or more sequences (None: ``serving_s``). ``serving_streams`` / ``serving_streams_s``, when
    given, replace that constant by a table: per stream and round when a step streams that many sequences,
    linear between the measured counts and the nearest count's value outside them (``serving_round_s``). On 2
    cores the cost is not a constant of the machine: on the embedded engine 15 ms at c1, ~10 ms per stream at
    c2 and well under 1 ms per stream at c16 (docs/replay.md, "The serving path per stream count"), so measure it at the stream counts a pool
    serves (``python -m bench.serving_cost --concurrency 2 4 8 16``)."""

    format: Literal[1]
    model: str
    revision: str  # the target weights' sha256 ("sha256:..."), as a trace header's
    hardware: str = ""
    source: str = ""  # "specgate trace calibrate", "sglang bench_one_batch", ...
    created: str = ""  # ISO 8601, UTC
    batch: list[int] = msgspec.field(default_factory=lambda: [1])
    forward: list[Grid]
    prefill: Grid
    draft: dict[str, DraftCost] = {}
    overhead_s: float = 0.0
    serving_s: float = 0.0
    serving_concurrent_s: float | None = None
    serving_streams: list[int] = []
    serving_streams_s: list[float] = []

    def __post_init__(self) -> None:
        if not self.revision:
            raise ValueError("field revision: empty; give the target weights' revision (specgate model info) "
                             "so a replay can check the model it times")
        _ascending("batch", self.batch, 1, "batch sizes")
        if len(self.forward) != len(self.batch):
            raise ValueError(f"field forward: {len(self.forward)} grids for {len(self.batch)} batch sizes "
                             f"{self.batch}; give one grid per entry of batch")
        if "none" in self.draft:
            raise ValueError("field draft.none: proposer none drafts nothing; remove the entry")
        _seconds("overhead_s", self.overhead_s, zero=True)
        _seconds("serving_s", self.serving_s, zero=True)
        if self.serving_concurrent_s is not None:
            _seconds("serving_concurrent_s", self.serving_concurrent_s, zero=True)
        if self.serving_streams or self.serving_streams_s:
            _ascending("serving_streams", self.serving_streams, 2, "stream counts")
            if len(self.serving_streams_s) != len(self.serving_streams):
                raise ValueError(f"field serving_streams_s: {len(self.serving_streams_s)} values for "
                                 f"{len(self.serving_streams)} stream counts {self.serving_streams}; give one "
                                 "per entry of serving_streams")
            for i, value in enumerate(self.serving_streams_s):
                _seconds(f"serving_streams_s[{i}]", value, zero=True)

    def serving_round_s(self, streams: int) -> float:
        """Seconds the serving path adds to each round of a step that streams ``streams`` sequences: ``serving_s``
        for one; for more, the ``serving_streams`` table (linear between its counts, the nearest count's value
        outside them), else ``serving_concurrent_s``, else ``serving_s``."""
        if streams <= 1:
            return self.serving_s
        counts = self.serving_streams
        if counts:
            return line(counts, self.serving_streams_s, min(max(streams, counts[0]), counts[-1]))
        return self.serving_s if self.serving_concurrent_s is None else self.serving_concurrent_s

    def forward_s(self, tokens: int, context: int, batch: int = 1) -> float:
        """One target forward of ``batch`` sequences, each feeding ``tokens`` after ``context`` cached ones.
        Between two measured batch sizes: linear. Below the smallest: the smallest's grid (a smaller batch
        is assumed no cheaper). Above the largest: ``batch / largest`` times the largest's value, as if the
        forward ran that many times over: exact for an engine that runs one sequence per forward (a file
        holding batch [1]), and an upper bound on a batching engine, whose forward grows slower until it
        saturates; measure the batch sizes a pool serves (``specgate trace calibrate --batches``). A step
        of sequences at different shapes: replay.profile.step_s."""
        _check_query(tokens=tokens, context=context, batch=batch)
        sizes = self.batch
        if batch >= sizes[-1]:
            return self.forward[-1].at(tokens, context) * batch / sizes[-1]
        if batch <= sizes[0]:
            return self.forward[0].at(tokens, context)
        i = bisect_right(sizes, batch) - 1
        low, high = self.forward[i].at(tokens, context), self.forward[i + 1].at(tokens, context)
        return low + (high - low) * (batch - sizes[i]) / (sizes[i + 1] - sizes[i])

    def prefill_s(self, tokens: int, context: int) -> float:
        """One prefill chunk of ``tokens`` after ``context`` cached ones (the caller splits a prompt into
        chunks as the engine does: ``prefill_chunk`` tokens per forward, the last prompt token left for the
        first round)."""
        _check_query(tokens=tokens, context=context)
        return self.prefill.at(tokens, context)

    def draft_s(self, proposer: str, k: int, context: int) -> float:
        """One propose call drafting ``k`` tokens from a committed context of ``context`` tokens; 0 for
        proposer none or k = 0 (no call)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if proposer == "none" or k == 0:
            return 0.0
        cost = self._draft(proposer)
        return cost.call_s + k * cost.token(context)

    def setup_s(self, proposer: str, prompt_tokens: int) -> float:
        """Once per request, before its first draft (on top of that round's ``draft_s``): what the proposer
        spends on a prompt of ``prompt_tokens`` tokens; 0 for proposer none."""
        return 0.0 if proposer == "none" else prompt_tokens * self._draft(proposer).setup_token_s

    def _draft(self, proposer: str) -> DraftCost:
        cost = self.draft.get(proposer)
        if cost is None and proposer == "hybrid" and "ngram" in self.draft and "suffix" in self.draft:
            # hybrid calls both model-free sources every round (proposers/hybrid.py): their costs add up
            return _both(self.draft["ngram"], self.draft["suffix"])
        if cost is None:
            known = ", ".join(sorted(self.draft)) or "none"
            raise ValueError(f"the cost model has no draft cost for proposer {proposer!r} (it has: {known}); "
                             f"recalibrate with that proposer (specgate trace calibrate) or add draft.{proposer}")
        return cost

    def round_s(self, proposer: str, k: int, context: int) -> float:
        """One round at batch 1: the draft, the target forward of the last committed token and the k drafts,
        and the overhead. Proposer none is a plain step: k must be 0."""
        if proposer == "none" and k != 0:
            raise ValueError(f"proposer none is a plain step: k must be 0, got {k}")
        return self.draft_s(proposer, k, context) + self.forward_s(k + 1, context) + self.overhead_s


def _both(first: DraftCost, second: DraftCost) -> DraftCost:
    """One call of each proposer, as one cost. Per-token costs add at every context of either (a worker's live
    step costs give n-gram and suffix a ``token_s``: policies/live_costs.py): each is linear between its own
    contexts and flat beyond them, so the sum is exact at and between the union of their contexts."""
    contexts = sorted(set(first.context) | set(second.context))
    points = contexts or [0]
    token_s = [first.token(c) + second.token(c) for c in points] if first.token_s or second.token_s else []
    return DraftCost(call_s=first.call_s + second.call_s, context=contexts if token_s else [], token_s=token_s,
                     setup_token_s=first.setup_token_s + second.setup_token_s)


def _check_query(**values: int) -> None:
    least = {"tokens": 1, "context": 0, "batch": 1}
    for name, value in values.items():
        if value < least[name]:
            raise ValueError(f"{name} must be >= {least[name]}, got {value}")


class CostModelError(ValueError):
    """A cost model file that cannot be used: ``FILE: field PATH: what is wrong; what to do``."""


_DECODERS = {".json": msgspec.json.decode, ".yaml": msgspec.yaml.decode, ".yml": msgspec.yaml.decode}


def _field_error(exc: msgspec.ValidationError, raw: Any) -> str:
    """``_explain``, with a draft entry's name in its path (msgspec writes dict values as ``draft[...]``)."""
    message = _explain(exc, _UNKNOWN_FIELD)
    if "draft[...]" in message and isinstance(raw, dict) and isinstance(raw.get("draft"), dict):
        for name, entry in raw["draft"].items():
            try:
                msgspec.convert(entry, DraftCost)
            except msgspec.ValidationError as inner:
                text = _explain(inner, _UNKNOWN_FIELD)
                if text.startswith("field "):
                    return f"field draft.{name}.{text.removeprefix('field ')}"
                return f"field draft.{name}: {text[0].lower()}{text[1:]}"
    if message.startswith("field format:"):
        message += f"; this specgate reads cost model format {FORMAT}"
    return message


def load_cost_model(path: str | Path, *, revision: str | None = None) -> CostModel:
    """Read and check a cost model file (JSON, or YAML by its suffix). ``revision``: the target weights
    the replay runs; a model measured on other weights is refused."""
    path = Path(path)
    decode = _DECODERS.get(path.suffix.lower())
    if decode is None:
        raise CostModelError(f"{path}: unknown suffix {path.suffix!r}; name the file .json, .yaml or .yml")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CostModelError(f"{path}: cannot read ({exc.strerror}); write one with specgate trace calibrate") \
            from None
    try:
        model = decode(data, type=CostModel)
    except msgspec.ValidationError as exc:
        try:
            raw = decode(data)
        except msgspec.DecodeError:
            raw = None
        raise CostModelError(f"{path}: {_field_error(exc, raw)}") from None
    except msgspec.DecodeError as exc:
        kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
        raise CostModelError(f"{path}: malformed {kind} ({exc})") from None
    check_revision(model, revision, str(path))
    return model


def check_revision(model: CostModel, revision: str | None, where: str) -> None:
    if revision is not None and model.revision != revision:
        raise CostModelError(f"{where}: field revision: the cost model was calibrated for model revision "
                             f"{model.revision}, this model is {revision}; recalibrate (specgate trace calibrate) "
                             "on this model")


def _pretty(value: Any, indent: int = 0) -> str:
    """JSON with one key per line and each list of numbers (a grid row) on one line."""
    pad = " " * indent
    if isinstance(value, dict) and value:
        items = [f"{pad}  {json.dumps(key)}: {_pretty(item, indent + 2)}" for key, item in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        items = [f"{pad}  {_pretty(item, indent + 2)}" for item in value]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(value)


def from_measurements(measured: dict[str, Any], where: str = "calibration") -> CostModel:
    """The CostModel of ``backends/engine/calibrate.calibrate``'s measurements (the file's fields as plain
    data, without ``format``), checked as a file is; ``where`` names their source in an error."""
    try:
        return msgspec.convert({**measured, "format": FORMAT}, CostModel)
    except msgspec.ValidationError as exc:
        raise CostModelError(f"{where}: {_field_error(exc, measured)}") from None


def write_cost_model(path: str | Path, model: CostModel) -> None:
    """Write ``model`` as JSON, readable and editable by hand; whole or not at all (a temporary file beside
    ``path``, renamed over it)."""
    path = Path(path)
    text = _pretty(msgspec.to_builtins(model)) + "\n"
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # measurements, not user content: readable like any config file
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
