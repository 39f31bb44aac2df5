"""Plain value types shared by the engine, its scheduler and the worker server.

No torch here (CONTRIBUTING.md #1): these are ids, lengths and settings. The worker turns SGLang wire
fields into these; the engine turns them into tensors.

Vocabulary (docs/architecture.md, "Vocabulary"): per round the proposer drafts k tokens, the target accepts a prefix of n <= k,
then emits one more token: *recovered* (after a rejection) or *bonus* (when n == k). A round commits
n + 1 tokens (fewer when a stop cuts it). Accept length always includes that extra token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from speculation import (  # noqa: F401  (the vocabulary, defined once; re-exported for the engine's modules)
    ADAPTIVE_STRATEGIES, MAX_DRAFT_TOKENS, NGRAM_MATCHES, PROPOSERS, SCOPE_MAX_CHARS, NgramMatch, Proposer,
)

# test-only faults in speculation (backends/engine/faults.py); "off" is exact speculative decoding
FaultMode = Literal["off", "lossy_accept", "random_draft"]
FAULT_MODES: tuple[str, ...] = ("off", "lossy_accept", "random_draft")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The subset of SGLang's sampling_params the engine implements (same names and defaults)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0  # < 1e-6 means greedy, as in SGLang
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6


@dataclass(frozen=True, slots=True)
class SpeculationParams:
    """How one request speculates. ``proposer='none'`` is plain decoding through the same runner."""

    proposer: Proposer = "none"
    draft_tokens: int = 4  # k, 1..MAX_DRAFT_TOKENS; with adaptive, the upper bound
    adaptive: bool = False  # let the engine pick k per round (backends/engine/adaptive.py)
    # with adaptive: which controller picks k (adaptive.STRATEGIES); "vllm" reads k_by_batch, (lowest batch
    # size, k) pairs ascending; "beta" starts from prior, per-position acceptance rates (empty: uniform)
    strategy: str = "beta"
    k_by_batch: tuple[tuple[int, int], ...] = ()
    prior: tuple[float, ...] = ()
    # n-gram lookup (proposers/ngram.py): the longest suffix of n in ngram_min..ngram_max tokens that occurred
    # earlier; of its occurrences, the earliest (transformers' prompt lookup and vLLM do the same) or latest
    ngram_min: int = 1
    ngram_max: int = 12
    ngram_match: NgramMatch = "earliest"
    # suffix decoding (proposers/suffix.py, and hybrid's suffix source): whose earlier outputs this request may
    # draft from. The gateway sends the route's name, so one application never sees another's text; "" is the
    # worker's shared scope.
    scope: str = ""

    def __post_init__(self) -> None:
        if self.proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {', '.join(PROPOSERS)}, got {self.proposer!r}")
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be in 1..{MAX_DRAFT_TOKENS}, got {self.draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}..{self.ngram_max}")
        if self.ngram_match not in NGRAM_MATCHES:
            raise ValueError(f"ngram_match must be one of {', '.join(NGRAM_MATCHES)}, got {self.ngram_match!r}")
        if self.strategy not in ADAPTIVE_STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(ADAPTIVE_STRATEGIES)}, got {self.strategy!r}")
        if self.proposer == "hybrid" and self.adaptive and self.strategy != "beta":
            raise ValueError(f"proposer hybrid picks its source and k with strategy beta, got {self.strategy!r}; "
                             "use strategy beta or another proposer")
        if any(lo < 1 or k < 0 for lo, k in self.k_by_batch) or list(self.k_by_batch) != sorted(self.k_by_batch):
            raise ValueError("k_by_batch must be ascending (lowest batch size >= 1, k >= 0) pairs")
        if len(self.prior) > MAX_DRAFT_TOKENS or not all(0.0 <= p <= 1.0 for p in self.prior):
            raise ValueError(f"prior must be at most {MAX_DRAFT_TOKENS} acceptance rates in [0, 1]")
        if len(self.scope) > SCOPE_MAX_CHARS:
            raise ValueError(f"scope must be at most {SCOPE_MAX_CHARS} characters, got {len(self.scope)}")


@dataclass(frozen=True, slots=True)
class SuffixSettings:
    """Suffix decoding (arXiv 2411.04975) as arctic-inference implements it; defaults are vLLM's ``suffix``
    method's. Per scope (route) one global tree over earlier outputs, FIFO-bounded to
    ``max_cached_requests`` responses; at most ``max_scopes`` scopes, least recently used evicted."""

    max_tree_depth: int = 24  # longest context suffix matched (and longest draft)
    max_cached_requests: int = 1000  # earlier responses kept per scope
    max_spec_factor: float = 1.0  # draft at most max_spec_factor * match length + max_spec_offset tokens
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # stop drafting where the continuation's estimated frequency falls below
    max_scopes: int = 64

    def __post_init__(self) -> None:
        for name in ("max_tree_depth", "max_cached_requests", "max_scopes"):
            if getattr(self, name) < 1:
                raise ValueError(f"suffix {name} must be >= 1, got {getattr(self, name)}")
        if self.max_spec_factor <= 0:
            raise ValueError(f"suffix max_spec_factor must be > 0, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"suffix min_token_prob must be in [0, 1], got {self.min_token_prob}")


MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's bound for chat top_logprobs)


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    speculation: SpeculationParams = SpeculationParams()
    # None: no logprobs; N >= 0: every committed token's logprob and its N most likely alternatives
    # (SGLang's return_logprob + top_logprobs_num)
    logprobs: int | None = None
    # with logprobs: also the prompt's tokens' (SGLang's logprob_start_len >= 0, OpenAI's echo + logprobs)
    prompt_logprobs: bool = False


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One committed token's log-probability under the distribution the target samples from (after
    penalties and temperature, before top-k/top-p/min-p truncation; greedy: the penalised logits), as
    SGLang reports it, and the ``top`` most likely tokens of that distribution: (token id, logprob),
    most likely first. The same numbers whether the token came from a draft or from plain decoding."""

    token_id: int
    logprob: float | None  # None only for the first prompt token: nothing precedes it
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class FinishReason:
    """SGLang's finish_reason: {"type": "stop", "matched": ...} | {"type": "length", "length": N} |
    {"type": "abort", "message": ..., "status_code": ...}."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None

    def to_dict(self) -> dict:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message, "status_code": self.status_code}


@dataclass(frozen=True, slots=True)
class RoundStats:
    """One speculative round (or one plain step, where k == 0)."""

    k: int  # drafts proposed this round (0: plain step, or the proposer found nothing)
    accepted: int  # n <= k
    budget: int  # drafts the round asked for (draft length, capped by the tokens left); k <= budget
    committed: int  # tokens actually committed (n + 1, fewer when a stop cut the round)
    bonus: bool  # every draft accepted, extra token drawn from p
    draft_s: float
    verify_s: float
    overhead_s: float
    # what the round would have cost as a plain step (the engine's estimate, Engine._verify): its step's forward
    # times StepCosts.plain_share, plus the overhead; None (a round recorded without an estimate) counts the
    # round's own seconds
    plain_s: float | None = None
    # what the round's drafts cost the other sequences of its step: each of them waited for the drafting and the
    # wider forward, (sequences - 1) x (the forward less its plain share + the draft seconds) (Engine._verify)
    neighbour_s: float = 0.0


@dataclass(slots=True)
class RequestStats:
    """Per-request totals, reported by the worker as SGLang's spec_* meta_info fields."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    verify_ct: int = 0  # forward passes of the target that committed tokens (rounds incl. plain steps)
    num_proposed_drafts: int = 0
    num_correct_drafts: int = 0
    # histogram[n] = rounds in which exactly n drafts were accepted (SGLang's spec_correct_drafts_histogram)
    correct_drafts_histogram: list[int] = field(default_factory=list)
    # accepted_per_position[j] = rounds in which draft position j+1 was accepted (vLLM's per-position counter)
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)
    # reached_per_position[j] = rounds in which position j+1 was within the round's budget AND drafts 1..j were
    # accepted, so a_{j+1} = accepted_per_position[j] / reached_per_position[j] is the chance the round gets
    # one more token at j+1, whether the proposer drafted nothing there or the target rejected the draft.
    # That is what E[P](k) needs for a proposer that may draft fewer than k (suffix, n-gram without a match);
    # counting only drafted positions over-predicted such a proposer (its rounds that drafted all k were the
    # only ones seen at position k). SGLang's histogram gives the same counts (policies/accept.py).
    reached_per_position: list[int] = field(default_factory=list)
    # chosen_per_k[k] = rounds whose budget was k drafts (the draft length asked for, after the cap by the
    # tokens left): what a per-round controller chose; one bar at draft_tokens for a fixed pool
    chosen_per_k: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0
    plain_s: float = 0.0  # sum of RoundStats.plain_s
    neighbour_s: float = 0.0  # sum of RoundStats.neighbour_s: seconds its drafts added to the others' steps
    queue_s: float = 0.0  # waiting before the first forward
    prefill_chunks: int = 0  # forwards that fed part of its prompt (at most --chunked-prefill-size tokens each)
    first_token_s: float | None = None  # from submit to the first committed token
    e2e_s: float | None = None

    @property
    def accept_length(self) -> float:
        """completion_tokens / verify_ct, as SGLang computes spec_accept_length (includes the bonus)."""
        return self.completion_tokens / self.verify_ct if self.verify_ct else 0.0

    @property
    def plain_ratio(self) -> float | None:
        """The engine's estimate of plain decoding's time for this request's tokens over the time its rounds
        took: plain needs one step per token, each costing the mean of the rounds' ``plain_s``; the rounds
        cost draft + verify + overhead. 1.0 for a request that never drafted; None before any round."""
        spent = self.draft_s + self.verify_s + self.overhead_s
        if not self.verify_ct or spent <= 0:
            return None
        return self.completion_tokens * self.plain_s / (self.verify_ct * spent)

    def record(self, r: RoundStats) -> None:
        self.verify_ct += 1
        self.num_proposed_drafts += r.k
        self.num_correct_drafts += r.accepted
        while len(self.correct_drafts_histogram) <= r.accepted:
            self.correct_drafts_histogram.append(0)
        self.correct_drafts_histogram[r.accepted] += 1
        while len(self.chosen_per_k) <= r.budget:
            self.chosen_per_k.append(0)
        self.chosen_per_k[r.budget] += 1
        while len(self.proposed_per_position) < max(r.k, r.budget):
            self.proposed_per_position.append(0)
            self.accepted_per_position.append(0)
            self.reached_per_position.append(0)
        for j in range(max(r.k, r.budget)):
            if j < r.k:
                self.proposed_per_position[j] += 1
            if j <= r.accepted:
                self.reached_per_position[j] += 1
            if j < r.accepted:
                self.accepted_per_position[j] += 1
        self.draft_s += r.draft_s
        self.verify_s += r.verify_s
        self.overhead_s += r.overhead_s
        self.plain_s += r.draft_s + r.verify_s + r.overhead_s if r.plain_s is None else r.plain_s
        self.neighbour_s += r.neighbour_s


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One event for one request: tokens committed since the last event, and cumulative state.

    ``text`` is the cumulative detokenized output so far (stop strings trimmed once finished);
    ``output_ids`` the cumulative committed ids. The final event has ``finished`` and ``finish_reason``.
    """

    rid: str
    new_token_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    stats: RequestStats
    logprobs: tuple[TokenLogprob, ...] = ()  # cumulative, one per output id (only when requested)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # one per prompt id, once prefilled (only when requested)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What /v1/loads reports; token counts are KV slots (target cache positions)."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    max_running_requests: int

    @property
    def token_usage(self) -> float:
        return self.num_used_tokens / self.max_total_num_tokens if self.max_total_num_tokens else 0.0
