"""The policy file's schema: strict msgspec Structs (unknown keys, wrong types, out-of-range values are errors).

Cross-field checks that need only one Struct live in ``__post_init__`` (msgspec reports them at that
Struct's YAML path); checks that span the file (a rule naming a pool that does not exist, unreachable
rules, duplicate names) live in :mod:`policies.checks`. Field names with a dot (``pool.kv_usage``) are
spelled exactly as in YAML. See docs/policy.md for every key.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, field


from policies.pairs import (  # noqa: F401  (re-exported: the policy file's pairs)
    DRAFT_PARAMS, DraftId, DraftKind, ModelId, Pair, ParamValue, pair_version,
)
from policies.gate_settings import (  # noqa: F401  (re-exported: the policy file's gates)
    GATE_STATES, Collapse, Equivalence, Gates, GateState, OutcomeCheck, SampledCheck, Serving,
)
from policies.schema_base import (  # noqa: F401  (re-exported)
    DraftLen, Fraction, Name, PosFloat, PosInt, Proposer, ResponseFormat, Url, _Strict,
)
from speculation import parse_k_by_batch  # noqa: F401  (the policy's k_by_batch parser; re-exported)


DEFAULT_ROUTE = "default"


class Slo(_Strict, kw_only=True):
    """Service-level objective; a route's SLO overrides the default field by field."""

    ttft_ms: PosFloat | None = None
    tpot_ms: PosFloat | None = None

    def merged(self, override: Slo | None) -> Slo:
        if override is None:
            return self
        return Slo(ttft_ms=override.ttft_ms if override.ttft_ms is not None else self.ttft_ms,
                   tpot_ms=override.tpot_ms if override.tpot_ms is not None else self.tpot_ms)


class SloOverride(_Strict, kw_only=True):
    """Whether a route's clients may state their own SLO per request (the ``x-slo-ttft-ms`` and ``x-slo-tpot-ms``
    headers, docs/api.md), and how tight: a header below ``min_ttft_ms`` / ``min_tpot_ms`` is refused (400), as
    is any such header when ``allow`` is false. Without this section a route accepts them."""

    allow: bool = True
    min_ttft_ms: PosFloat | None = None
    min_tpot_ms: PosFloat | None = None

    def __post_init__(self) -> None:
        if not self.allow and (self.min_ttft_ms is not None or self.min_tpot_ms is not None):
            raise ValueError("min_ttft_ms and min_tpot_ms bound the SLO headers a route allows; with allow: false "
                             "remove them")


class RateLimit(_Strict, kw_only=True):
    requests_per_s: PosFloat | None = None
    tokens_per_min: PosInt | None = None
    burst: PosInt | None = None


class Route(_Strict, kw_only=True):
    """An application. A route with neither ``api_keys_env`` nor ``api_keys_file`` is the default route:
    requests without a recognised key belong to it. With no routes at all, auth is off and every request
    belongs to an implicit route named ``default``."""

    name: Name
    api_keys_env: Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None = None
    api_keys_file: str | None = None
    slo: Slo | None = None
    slo_override: SloOverride | None = None
    rate_limit: RateLimit | None = None
    max_concurrency: PosInt | None = None

    @property
    def has_keys(self) -> bool:
        return self.api_keys_env is not None or self.api_keys_file is not None


class Range(_Strict, kw_only=True):
    """A numeric comparison; every bound given must hold. A bare number in YAML means ``eq``."""

    gt: float | None = None
    gte: float | None = None
    lt: float | None = None
    lte: float | None = None
    eq: float | None = None

    def __post_init__(self) -> None:
        if self.gt is None and self.gte is None and self.lt is None and self.lte is None and self.eq is None:
            raise ValueError("empty comparison; give at least one of gt, gte, lt, lte, eq")


class FractionRange(Range, kw_only=True):
    """A comparison on a 0..1 score (``code_score``, ``prompt_repeat``): a bound outside [0, 1] is an error, not
    a condition that silently always or never holds."""

    gt: Fraction | None = None
    gte: Fraction | None = None
    lt: Fraction | None = None
    lte: Fraction | None = None
    eq: Fraction | None = None


NumCond = float | Range
ScoreCond = Fraction | FractionRange
StrCond = str | list[str]
FormatCond = ResponseFormat | list[ResponseFormat]


class SliceWhen(_Strict, kw_only=True):
    """Conditions on request features; all given must hold."""

    route: StrCond | None = None
    model: StrCond | None = None
    has_tools: bool | None = None
    response_format: FormatCond | None = None
    prompt_tokens: NumCond | None = None
    max_tokens: NumCond | None = None
    temperature: NumCond | None = None
    stream: bool | None = None
    code_score: ScoreCond | None = None
    prompt_repeat: ScoreCond | None = None
    # the request's own SLO: its x-slo-* header, else its route's (absent: the condition does not hold)
    slo_ttft_ms: NumCond | None = None
    slo_tpot_ms: NumCond | None = None
    headers: dict[str, StrCond] | None = None


class RuleWhen(SliceWhen, kw_only=True):
    """Slice conditions plus live state. ``pool.*``, ``pair_verified``, ``pair_gate`` and ``stats.*`` are checked on the
    subject pools: ``pool`` if given, else the action's pool(s), else every speculative pool; the condition
    holds when it holds for ANY subject pool."""

    slice: StrCond | None = None
    budget_tokens: NumCond | None = None
    concurrency: NumCond | None = None
    pool: Name | None = None
    pool_healthy: bool | None = field(default=None, name="pool.healthy")
    pool_kv_usage: NumCond | None = field(default=None, name="pool.kv_usage")
    pool_running: NumCond | None = field(default=None, name="pool.running")
    pool_waiting: NumCond | None = field(default=None, name="pool.waiting")
    pool_workers_healthy: NumCond | None = field(default=None, name="pool.workers_healthy")
    pair_verified: bool | None = None
    # the subject pool's rollout gate (policies/gate_settings.py); only with a ``gates:`` section
    pair_gate: GateState | list[GateState] | None = None
    stats_mean_accept_length: NumCond | None = field(default=None, name="stats.mean_accept_length")
    stats_rounds: NumCond | None = field(default=None, name="stats.rounds")
    stats_requests: NumCond | None = field(default=None, name="stats.requests")


class Slice(_Strict, kw_only=True):
    """First match wins; a slice without ``when`` is the default slice and must come last."""

    name: Name
    when: SliceWhen | None = None


class DraftRange(_Strict, kw_only=True):
    min: DraftLen
    max: DraftLen

    def __post_init__(self) -> None:
        if self.min > self.max:
            raise ValueError(f"min {self.min} > max {self.max}; swap them")


class Pool(_Strict, kw_only=True):
    """Workers serving one speculative configuration. ``speculation: server`` means SGLang servers launched
    with it (k fixed); ``per_request`` means the embedded worker, told per request via
    ``custom_params.speculation = {proposer, draft_tokens, adaptive}``. ``adaptive: true`` (per_request only)
    lets the worker pick k per round and per sequence, 0 to ``draft_tokens`` (its adaptive draft length:
    plain steps where the prompt gives the proposer nothing to copy); auto then treats the pool as one
    option, judged by its measured TPOT. ``strategy`` picks the worker's per-round controller
    (backends/engine/adaptive.py, baselines.py): ``beta`` (specgate's), ``sglang`` (SGLang's --speculative-adaptive) or
    ``vllm`` with ``k_by_batch``, vLLM's ``num_speculative_tokens_per_batch_size`` ({"1-3": 8, "4-15": 4,
    "16-4096": 0}: inclusive batch-size ranges, gaps keep the previous range's k). Proposer ``hybrid``
    (specgate's worker only, like ``suffix``: SGLang has neither) drafts from n-gram and suffix every round and
    picks the source per round (backends/engine/proposers/hybrid.py); with ``adaptive`` also k, by ``beta``."""

    proposer: Proposer
    draft_tokens: DraftLen | DraftRange | None = None
    pair: Name | None = None
    workers: Annotated[list[Url], Meta(min_length=1)]
    speculation: Literal["server", "per_request"] = "server"
    adaptive: bool = False
    strategy: Literal["beta", "sglang", "vllm"] = "beta"
    k_by_batch: dict[str, Annotated[int, Meta(ge=0, le=64)]] | None = None

    def __post_init__(self) -> None:
        if not self.adaptive and (self.strategy != "beta" or self.k_by_batch is not None):
            raise ValueError("strategy and k_by_batch choose the worker's per-round controller; they need "
                             "adaptive: true")
        if (self.strategy == "vllm") != (self.k_by_batch is not None):
            raise ValueError("k_by_batch goes with strategy: vllm, and strategy: vllm needs k_by_batch "
                             '(e.g. {"1-3": 8, "4-15": 4, "16-4096": 0})')
        if self.k_by_batch is not None:
            parse_k_by_batch(",".join(f"{span}:{k}" for span, k in self.k_by_batch.items()))
        if self.proposer == "hybrid" and self.strategy != "beta":
            raise ValueError(f"proposer hybrid picks its source and k per round with strategy beta, not "
                             f"{self.strategy}; remove strategy or use another proposer")
        if self.proposer == "none":
            if self.draft_tokens is not None:
                raise ValueError("proposer none takes no draft_tokens; remove it")
            if self.adaptive:
                raise ValueError("proposer none takes no adaptive; remove it")
            return
        if self.draft_tokens is None:
            raise ValueError(f"proposer {self.proposer} needs draft_tokens (an int or {{min, max}})")
        if self.pair is None:
            raise ValueError(f"proposer {self.proposer} needs a pair (the target-draft artifact it serves)")
        if self.speculation == "server" and isinstance(self.draft_tokens, DraftRange):
            raise ValueError("a server pool's draft length is fixed when its server starts; give an int "
                             "or use speculation: per_request")
        if self.adaptive:
            if self.speculation != "per_request":
                raise ValueError("adaptive: true needs speculation: per_request (the embedded worker picks k "
                                 "per sequence; a server's k is fixed at launch)")
            if isinstance(self.draft_tokens, DraftRange):
                raise ValueError("an adaptive pool's draft_tokens is the largest k the worker may pick "
                                 f"(an int, e.g. {self.draft_tokens.max}), not a range")

    @property
    def batch_table(self) -> tuple[tuple[int, int], ...]:
        """``k_by_batch`` as ascending (lowest batch size, k) pairs (empty without it)."""
        if self.k_by_batch is None:
            return ()
        return parse_k_by_batch(",".join(f"{span}:{k}" for span, k in self.k_by_batch.items()))

    @property
    def k_range(self) -> tuple[int, int]:
        """(min, max) draft tokens; (0, 0) for proposer none."""
        k = self.draft_tokens
        if k is None:
            return (0, 0)
        if isinstance(k, int):
            return (k, k)
        return (k.min, k.max)


# Which draft kinds each proposer can run.
PROPOSER_KINDS: dict[str, tuple[str, ...]] = {
    "ngram": ("ngram",), "suffix": ("suffix",), "hybrid": ("suffix", "ngram"),
    "draft_model": ("layer_truncated", "model"),
    "standalone": ("model", "layer_truncated"), "eagle": ("eagle",), "eagle3": ("eagle3",),
}


class PoolAction(_Strict, kw_only=True):
    """Serve on ``pool`` (fixed or ``auto`` draft length), or pick among ``pools`` by predicted speedup."""

    pool: Name | None = None
    pools: list[Name] | None = None
    draft_tokens: DraftLen | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        if (self.pool is None) == (self.pools is None):
            raise ValueError("give exactly one of pool or pools")
        if self.pools is not None and self.draft_tokens != "auto":
            raise ValueError("draft_tokens with pools must be auto (each pool has its own range)")


Action = Literal["bypass", "auto"] | PoolAction


class Rule(_Strict, kw_only=True):
    """First match decides; a rule without ``when`` is a catch-all and must come last."""

    name: Name
    when: RuleWhen | None = None
    then: Action


# keys of ``learning`` that an earlier learner read and auto's Thompson sampling made unnecessary: a policy
# file that still has one is refused with this fix (policies/load.py)
REMOVED_LEARNING_KEYS = ("explore", "explore_cold", "confirm_requests", "min_requests", "prior", "draft_token_cost")


class Learning(_Strict, kw_only=True):
    """How ``auto`` learns (policies/auto.py): statistics lose half their weight every ``half_life_s``;
    a speculative option must beat plain decoding's posterior draw by ``min_gain``; contexts are the
    ``concurrency_buckets`` and the ``repeat_bands``; ``min_rounds``: decayed rounds a route's own acceptance
    needs before rule conditions read it instead of all routes' pooled acceptance. ``counterfactual``: every greedy
    answer also teaches auto what each fixed-k n-gram or suffix option of its rule would have cost (full
    information, replay/evidence.py); off, each request teaches only the option it was served with.
    ``slo_objective``: which TPOT SLO steers ``auto``'s choice toward the options likeliest to meet it
    (policies/auto.py, "SLO"): ``stated``, only one a request states itself (``x-slo-tpot-ms``); ``in_force``,
    its route's too; ``none`` (route and request SLOs then only judge goodput)."""

    half_life_s: PosFloat = 600.0
    min_rounds: Annotated[int, Meta(ge=0)] = 64
    min_gain: Annotated[float, Meta(ge=1.0)] = 1.05
    concurrency_buckets: Annotated[list[PosInt], Meta(min_length=1)] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    # prompt_repeat band edges: auto's context (policies/auto.py); on the shared workloads p10 / median / p90
    # of code, code_edit and long_context prompts are ~0.0 / 0.07 / 0.19
    repeat_bands: list[Annotated[float, Meta(ge=0.0, le=1.0)]] = field(default_factory=lambda: [0.05, 0.15])
    counterfactual: bool = True
    slo_objective: Literal["stated", "in_force", "none"] = "stated"


class Resume(_Strict, kw_only=True):
    """Resuming an answer whose worker failed after its first byte (``gateway/resume.py``, docs/reliability.md):
    the prompt's ids + the ids already sent, on another healthy worker of the pool serving the same target.
    ``max_resumes``: per request (0: never resume; the stream ends with an error event as before);
    ``deadline_s``: no resume starts once the request has run this long; ``fallback``: a resume may go to the
    plain fallback pool when the served pool has no other healthy worker; ``whole_answers``: a whole (non-streamed)
    answer that may resume is streamed from its worker and assembled at the gateway, so it resumes like a stream
    (false: it is asked for whole, and a worker failure serves it again from token 0)."""

    max_resumes: Annotated[int, Meta(ge=0, le=8)] = 1
    deadline_s: PosFloat = 300.0
    fallback: bool = True
    whole_answers: bool = True


class Tracing(_Strict, kw_only=True):
    """Opt-in recording of served requests as a replay trace (``gateway/tracing.py``, docs/replay.md). ``path``:
    relative to the policy file's folder, which must exist; ``max_bytes``: a file is rotated before a line
    would take it past this; ``keep``: rotated files kept (``path.1`` newest); ``sample``: the share of
    requests recorded, picked by a hash of ``seed`` and the request id; ``routes``: only these (None: all);
    ``costs``: a cost model file (``specgate trace calibrate``, relative like ``path``) that ``POST
    /admin/replay`` times the recorded requests with (None: that endpoint is refused)."""

    path: Annotated[str, Meta(min_length=1)]
    max_bytes: Annotated[int, Meta(ge=1024)] = 64 * 1024 * 1024
    keep: Annotated[int, Meta(ge=0, le=1000)] = 4
    sample: Fraction = 1.0
    seed: int = 0
    routes: Annotated[list[Name], Meta(min_length=1)] | None = None
    costs: Annotated[str, Meta(min_length=1)] | None = None


class State(_Strict, kw_only=True):
    """Fleet state (``gateway/fleet.py``, docs/deploy.md#a-fleet-of-gateways): a Valkey/Redis server the gateways
    of one fleet share the learner's sums, exploration counts, pair gate verdicts, outcomes and route limits
    through. ``url``: ``valkey://``, ``redis://`` or ``rediss://`` (TLS) host, port and database (no password
    in it: ``password_env`` or ``password_file``); ``key_prefix``: namespaces every key, so two fleets can share
    one server; ``sync_interval_s``: how often a replica flushes its evidence and reads the fleet's;
    ``timeout_ms``: the longest one call to the server may take before the replica runs on its local state."""

    url: Annotated[str, Meta(pattern=r"^(valkey|valkeys|redis|rediss)://[^\s]+$")]
    key_prefix: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")] = "specgate"
    password_env: Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None = None
    password_file: Annotated[str, Meta(min_length=1)] | None = None
    sync_interval_s: Annotated[float, Meta(ge=0.05, le=10.0)] = 0.5
    timeout_ms: Annotated[float, Meta(ge=1.0, le=5000.0)] = 250.0

    def __post_init__(self) -> None:
        if "@" in self.url.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError("state.url must not carry credentials: give the password with password_env or "
                             "password_file")
        if self.password_env and self.password_file:
            raise ValueError("give one of state.password_env or state.password_file, not both")


class Policy(_Strict, kw_only=True, weakref=True):
    """A whole policy file. Hot reload: build a new one with ``load_policy_file`` and swap the reference;
    Policies are immutable, so a request holding the old one finishes consistently."""

    version: Literal[1]
    slo: Slo = Slo()
    routes: list[Route] = []
    slices: Annotated[list[Slice], Meta(min_length=1)]
    pools: Annotated[dict[Name, Pool], Meta(min_length=1)]
    pairs: dict[Name, Pair] = {}
    rules: list[Rule] = []
    learning: Learning = Learning()
    resume: Resume = Resume()  # mid-answer worker failures (gateway/resume.py)
    tracing: Tracing | None = None  # off unless given (or `specgate serve --trace FILE`)
    gates: Gates | None = None  # the pair rollout gates (gateway/gates/); off unless given
    state: State | None = None  # fleet state shared through Valkey (gateway/fleet.py); none: in-process only

    def route(self, name: str) -> Route | None:
        for route in self.routes:
            if route.name == name:
                return route
        return None

    def route_names(self) -> list[str]:
        return [r.name for r in self.routes] or [DEFAULT_ROUTE]

    @property
    def default_route(self) -> str | None:
        """The route for requests without a recognised key (None: such requests are rejected)."""
        if not self.routes:
            return DEFAULT_ROUTE
        return next((r.name for r in self.routes if not r.has_keys), None)

    @property
    def auth_enabled(self) -> bool:
        return any(r.has_keys for r in self.routes)

    def route_slo(self, name: str) -> Slo:
        """The route's effective SLO: its own fields over the default."""
        route = self.route(name)
        return self.slo.merged(route.slo if route else None)

    def route_slo_override(self, name: str) -> SloOverride | None:
        route = self.route(name)
        return route.slo_override if route else None

    def pool_pair_version(self, pool: str) -> str:
        """The pair version a pool serves ('' for proposer none without a pair)."""
        pair = self.pools[pool].pair
        return pair_version(self.pairs[pair]) if pair and pair in self.pairs else ""
