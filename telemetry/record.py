"""One finished (or failed) gateway request, as telemetry sees it.

The gateway builds one ``RequestRecord`` per request after the last byte (or the error) and hands it
to ``Telemetry.observe`` (metrics, logs, dashboard history); the policy learner gets a
``policies.stats.Outcome`` built from the same values. Label-able fields (route, slice, pool,
proposer, rule, status class) come from the policy or from a closed set, never from the client, so
metric cardinality stays bounded; ``request_id`` and ``worker`` are for logs only.
"""

from __future__ import annotations

import msgspec


class Resumed(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One resume of an answer whose worker failed mid-answer (``gateway/resume.py``): at which token (ids sent
    before it), from which worker to which ("" when none took over), the pool that took over, and how it went:
    ok | failed | no_worker | no_ids | limit | deadline | structured | penalties | request_error."""

    at_token: int
    from_worker: str
    to_worker: str = ""
    pool: str = ""
    outcome: str


class RequestRecord(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """``array_like``: msgpack-encoded as an array, in field order, into the pipe to the trace exporter process
    (telemetry/otel_gateway.py): half the bytes of a map, and a third less encoding time."""

    request_id: str
    route: str  # policy route name ("default" when auth is off)
    slice: str  # policy slice name
    pool: str  # policy pool name ("" when the request never reached a pool)
    proposer: str  # one of speculation.POOL_PROPOSERS
    rule: str  # policy rule that decided ("" when rejected before deciding)
    reason: str = ""  # the decision's human-readable reason (logs only)
    draft_tokens: int = 0  # k chosen (0 = bypass)
    # why the auto decision measured an option instead of serving the best known one (None: it did not):
    # cold | thompson (policies.decide.Decision.exploration)
    exploration: str | None = None
    endpoint: str = "chat"  # chat | completions
    stream: bool = False
    status: str = "ok"  # ok | client_error | rate_limited | upstream_error | aborted | unavailable
    http_status: int = 200
    error_type: str | None = None
    error_message: str | None = None  # never contains prompt text or keys
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # gateway-observed: request received -> first content byte sent
    # streamed: (e2e - ttft) / (completion_tokens - 1) on the gateway's clock; whole answer: the worker's decode
    # time (first token to end) / (completion_tokens - 1), when the worker reports it (specgate's embedded one)
    tpot_s: float | None = None
    tpot_source: str | None = None  # stream | worker (which of the two above); None when tpot_s is None
    e2e_s: float | None = None
    overhead_s: float | None = None  # time the gateway itself added (parse, decide, dispatch, relay)
    # the mean load over this request's life, itself included, rounded: the gateway's requests in flight or,
    # when more, the busiest pool's running + waiting per worker (what the learner buckets by:
    # Outcome.concurrency); None when the gateway did not say. The dashboard's speedup table puts the request in
    # the load bucket of this value.
    concurrency: int | None = None
    # a speculative request's plain counterfactual: the TPOT plain decoding would have had, as the worker
    # estimates it (tpot_s x specgate_plain_ratio; specgate's embedded worker only). The speedup table falls back
    # on it where no request of a cell was served plain.
    plain_tpot_s: float | None = None
    # speculation as reported by the worker (absent for plain or when SGLang reports nothing)
    verify_ct: int | None = None
    accept_length: float | None = None
    num_proposed_drafts: int | None = None
    num_correct_drafts: int | None = None
    correct_drafts_histogram: list[int] | None = None
    accepted_per_position: list[int] | None = None
    reached_per_position: list[int] | None = None
    slo_ttft_s: float | None = None  # the route's SLO in force
    slo_tpot_s: float | None = None
    slo_met: bool | None = None  # both TTFT and TPOT met (DistServe goodput); None when not ok
    retries: int = 0
    resumes: tuple[Resumed, ...] = ()  # tries to resume it after its worker failed mid-answer, in order
    worker: str = ""  # URL, logs only
    fallback: bool = False  # a safety fallback changed the decision
    timestamp: float = 0.0  # wall clock (time.time()) when the request finished
    # Set ONLY when the gateway runs with its debug-text flag; logged only then, never exported as metrics.
    prompt_text: str | None = None
    completion_text: str | None = None

    @property
    def explored(self) -> bool:
        return self.exploration is not None
