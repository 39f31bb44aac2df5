"""Opt-in recording of served requests as a replay trace (docs/replay.md, "Recording in the gateway").

Off by default. On with the policy's ``tracing:`` section (``policies.schema.Tracing``) or ``specgate serve
--trace FILE``. The flag names the file: with no section, recording runs with the section's defaults; with
one, the flag's path replaces the section's and everything else is the section's. Policy reloads keep the
flag. A reload that changes ``tracing:`` applies from the next request admitted; a changed path closes the
file (it stays complete) and starts the new one.

Per request, three steps:

1. **Select** at admission (``select``): the route must be in ``routes`` (when given), and the request id,
   hashed with ``seed``, must fall in the ``sample`` fraction. Deterministic: the same id and seed always give
   the same answer, whatever the load or the order of arrival.
2. A selected request **asks its worker for token ids** (``backends/sglang/token_ids.py``); the gateway takes
   them out of the client's answer.
3. **Finish** (``finish``, called once from ``lifecycle.serve``'s ``finally``): a ``policies.trace.TraceRequest``
   built from the ``Finished`` value and appended as one line (``replay/trace_file.py``: 0600, rotation,
   never a partial line). Its fields come from values already checked (the parsed request, its features,
   the worker's answer decoded into ``wire`` Structs), the format's own checks run when it is built, and
   the ids are checked non-negative; decoding each line again as ``read_trace`` does would cost several
   times the encoding, on the event loop, so the tests do that instead.

Every request that finishes while recording is on is counted once, in ``specgate_trace_requests_total`` by
``result`` and in ``GET /admin/tracing``: ``recorded``, or why not: ``sampled_out``, ``route_excluded``,
``failed`` (any ending but a 200 answer), ``no_ids`` (the worker sent none: an SGLang without the token-id
fields, or recording began after the request did), ``unknown_worker`` (the worker reported no revision),
``other_revision`` (see below), ``invalid`` (the record failed the trace format's checks), ``too_large`` (one
record over ``max_bytes``), ``write_error`` (the disk refused it; the request is unaffected).

The header names the model, its weight revision and the tokenizer digest that the serving worker reports in
``/server_info`` (``revision``; ``specgate_tokenizer_digest`` from specgate's worker, "" from SGLang). The
first recorded request fixes them for the file. A request served by a worker of another revision is not
recorded (``other_revision``) rather than starting a new file: during a rolling upgrade both revisions serve
at once, and rotating at every alternation would push the kept files out within minutes. Changing the path
(a reload) or restarting starts a file that takes the next revision seen.

Token ids are user content: nothing here logs a record, an id or a prompt; log lines and errors name the
request id, the file and the problem only.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import structlog

from backends.sglang.wire import ServerInfo
from gateway.stages import Finished
from replay.trace_file import TooLarge, TraceFile, directory_problem
from policies.schema import Policy, Tracing
from policies.trace import FORMAT, Header, Sampling, Served, TraceRequest, encode_line

log = structlog.get_logger("specgate.gateway")

SOURCE = "specgate serve"
RESULTS = ("recorded", "sampled_out", "route_excluded", "failed", "no_ids", "unknown_worker", "other_revision",
           "invalid", "too_large", "write_error")
_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "tool_calls": "stop"}


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """``tracing:`` resolved: an absolute path, the flag applied."""

    path: Path
    max_bytes: int
    keep: int
    sample: float
    seed: int
    routes: frozenset[str] | None
    costs: Path | None = None  # the cost model POST /admin/replay uses


def resolve(tracing: Tracing | None, flag: str | None, policy_dir: Path) -> TraceConfig | None:
    """The recording in force for a policy (None: off). The section's ``path`` is relative to the policy's
    folder; the flag's, already absolute, wins over it."""
    if tracing is None and flag is None:
        return None
    section = tracing or Tracing(path=flag or "")
    path = Path(flag) if flag else policy_dir / section.path
    return TraceConfig(path=path.absolute(), max_bytes=section.max_bytes, keep=section.keep, sample=section.sample,
                       seed=section.seed, routes=frozenset(section.routes) if section.routes else None,
                       costs=(policy_dir / section.costs).absolute() if section.costs else None)


def problems(policy: Policy, flag: str | None, policy_dir: Path) -> list[str]:
    """Why recording as configured cannot run (a startup error; a reload with them is refused)."""
    config = resolve(policy.tracing, flag, policy_dir)
    if config is None:
        return []
    problem = directory_problem(config.path)
    where = "--trace" if flag else "tracing.path"
    found = [f"{where} {config.path}: {problem}"] if problem else []
    if config.costs is not None and not config.costs.is_file():
        found.append(f"tracing.costs {config.costs}: no such file; write one with specgate trace calibrate --out "
                     "FILE, or remove the key")
    return found


def sampled(seed: int, request_id: str, fraction: float) -> bool:
    """True for ``fraction`` of ids: the first 8 bytes of sha256("seed:id") as a number in [0, 1)."""
    if fraction >= 1.0:
        return True
    if fraction <= 0.0:
        return False
    digest = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < fraction


class Recorder:
    """The gateway's one recorder. ``worker_info(url)``: the worker's last ``/server_info`` (None: unknown)."""

    def __init__(self, config: TraceConfig | None, *, worker_info: Callable[[str], ServerInfo | None],
                 count: Callable[[str], None] = lambda result: None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.worker_info = worker_info
        self.count = count  # telemetry's counter (Telemetry.count_trace)
        self.t0 = clock()  # arrival_s is counted from here, in every file of this run
        self.counts = dict.fromkeys(RESULTS, 0)
        self.config: TraceConfig | None = None
        self.file: TraceFile | None = None
        self.header: Header | None = None
        self.last_error: str | None = None
        self.configure(config)

    def configure(self, config: TraceConfig | None) -> None:
        """Apply a (re)loaded configuration: a new path closes the current file and forgets its header."""
        old, self.config = self.config, config
        if old is not None and config is not None and old.path == config.path and self.file is not None:
            self.file.max_bytes, self.file.keep = config.max_bytes, config.keep
            return
        if self.file is not None:
            self.file.close()
        self.file = TraceFile(config.path, max_bytes=config.max_bytes, keep=config.keep) if config else None
        self.header = None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def select(self, route: str, request_id: str) -> str | None:
        """"record", "route_excluded" or "sampled_out"; None when recording is off."""
        c = self.config
        if c is None:
            return None
        if c.routes is not None and route not in c.routes:
            return "route_excluded"
        return "record" if sampled(c.seed, request_id, c.sample) else "sampled_out"

    def finish(self, f: Finished) -> None:
        """Record one finished request, or count why not (module docstring). Never raises. A request picked at
        admission (``Admitted.trace_ids``: it asked its worker for ids) is not picked again: one hash per
        request, and a reload between its admission and its end cannot change what it is counted as."""
        if self.config is None:
            return
        picked = f.admitted is not None and f.admitted.trace_ids
        selected = "record" if picked else self.select(f.route, f.arrival.request_id)
        if selected is None:
            return
        try:
            result = self._record(f) if selected == "record" else selected
        except Exception as exc:  # noqa: BLE001 - a recorder bug must not fail the request's finally
            log.error("trace_record_failed", request_id=f.arrival.request_id, error=type(exc).__name__)
            result = "invalid"
        self.counts[result] += 1
        self.count(result)

    def _record(self, f: Finished) -> str:
        a, d, served, r = f.admitted, f.decision, f.dispatched, f.relayed
        if not f.ok or a is None or d is None or served is None:
            return "failed"
        if not a.trace_ids or not r.prompt_ids or r.output_ids is None:
            return "no_ids"
        info = self.worker_info(served.worker)
        if info is None or not info.revision:
            return "unknown_worker"
        if self.header is None:
            self.header = Header(format=FORMAT, model=info.served_model_name or info.model_path or "",
                                 revision=info.revision, tokenizer=info.specgate_tokenizer_digest or "", source=SOURCE)
        elif info.revision != self.header.revision:
            return "other_revision"
        try:
            if min(r.prompt_ids) < 0 or r.output_ids and min(r.output_ids) < 0:
                raise ValueError("field prompt_ids or output_ids: a negative token id")
            line = encode_line(self._request(f, info))
        except ValueError as exc:  # the format's messages name fields and counts, never ids
            log.warning("trace_record_invalid", request_id=f.arrival.request_id, problem=str(exc))
            return "invalid"
        assert self.file is not None
        try:
            self.file.write(line, self._header_line)
        except TooLarge:
            return "too_large"
        except OSError as exc:
            self.last_error = f"{self.file.path}: {exc.strerror or type(exc).__name__}"
            log.error("trace_write_failed", request_id=f.arrival.request_id, path=str(self.file.path),
                      error=exc.strerror or type(exc).__name__)
            return "write_error"
        return "recorded"

    def _header_line(self) -> bytes:
        assert self.header is not None
        created = datetime.now(UTC).isoformat(timespec="seconds")
        return encode_line(msgspec.structs.replace(self.header, created=created))

    def _request(self, f: Finished, info: ServerInfo) -> TraceRequest:
        a, d, served, r = f.admitted, f.decision, f.dispatched, f.relayed
        assert a is not None and d is not None and served is not None and r.prompt_ids and r.output_ids is not None
        finish = _FINISH.get(r.finish or "", "stop")
        return TraceRequest(
            id=f.arrival.request_id, arrival_s=max(0.0, f.arrival.t0 - self.t0), route=f.route, slice=d.slice,
            features=a.features, sampling=_sampling(a.body, finish, r.prompt_ids, r.output_ids, info),
            served=Served(pool=served.pool, rule=d.rule, proposer=served.proposer, draft_tokens=served.draft_tokens,
                          finish=finish, ttft_s=r.ttft_s if f.stream else None, e2e_s=f.e2e_s),
            prompt_ids=r.prompt_ids, output_ids=r.output_ids)

    def status(self) -> dict[str, Any]:
        """``GET /admin/tracing``: the configuration in force, the file's header and sizes, the counts."""
        c, h = self.config, self.header
        return {
            "enabled": c is not None,
            "path": str(c.path) if c else None, "max_bytes": c.max_bytes if c else None,
            "keep": c.keep if c else None, "sample": c.sample if c else None, "seed": c.seed if c else None,
            "routes": sorted(c.routes) if c and c.routes else None,
            "header": None if h is None else {"model": h.model, "revision": h.revision, "tokenizer": h.tokenizer},
            "bytes": self.file.size if self.file else 0,
            "files": self.file.files() if self.file else [],
            "counts": dict(self.counts), "last_error": self.last_error,
        }


def _sampling(body: dict[str, Any], finish: str, prompt_ids: list[int], output_ids: list[int],
              info: ServerInfo) -> Sampling:
    """The sampling parameters as sent to the worker. An absent temperature is OpenAI's default, 1.0. An
    absent ``max_tokens``: a request that ended by length had exactly its output's length; otherwise the
    context window's room (the embedded worker's rule), which replay only needs near the end of the output."""
    temperature = body.get("temperature")
    budget = body.get("max_completion_tokens") or body.get("max_tokens")
    if budget is None:
        room = info.context_length - len(prompt_ids) if info.context_length else 0
        budget = len(output_ids) if finish == "length" or room < len(output_ids) else room
    return Sampling(temperature=1.0 if temperature is None else float(temperature), max_new_tokens=max(1, budget))
