"""What `specgate worker` is started with: the engine's configuration plus the server's identity.

The speculative defaults mirror SGLang's server flags (``--speculative-algorithm``,
``--speculative-num-draft-tokens``, ``--speculative-adaptive``, ``--speculative-ngram-min/max-match-window-size``):
a request without a ``custom_params.speculation`` override runs exactly as it would on an SGLang server
launched with them. ``SUFFIX`` (suffix decoding; vLLM's ``suffix`` method) and ``HYBRID`` (n-gram and suffix
drafts every round, the source picked per round: proposers/hybrid.py) are specgate's extensions: SGLang has
no such algorithms. The n-gram and suffix settings are server settings even for a worker that takes its
proposer per request: they change acceptance, so they are part of the pair version, and ``/server_info``
reports them under these field names (the flags with underscores).

``--fault-injection`` is a test switch (backends/engine/faults.py): it lets ``POST /specgate/fault`` break
speculation on purpose, so it is refused unless the worker listens on a loopback address only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from backends.engine.types import (
    ADAPTIVE_STRATEGIES, FAULT_MODES, MAX_DRAFT_TOKENS, NGRAM_MATCHES, FaultMode, NgramMatch, SpeculationParams,
    SuffixSettings,
)
from backends.net import is_loopback
from speculation import parse_k_by_batch

SpeculativeAlgorithm = Literal["NGRAM", "STANDALONE", "SUFFIX", "HYBRID"]
# SGLang's algorithm name -> the engine's proposer (STANDALONE = a separate draft model; ours is the
# layer-truncated self-draft; SUFFIX is specgate's own name).
ALGORITHM_PROPOSER: dict[str, str] = {"NGRAM": "ngram", "STANDALONE": "draft_model", "SUFFIX": "suffix",
                                      "HYBRID": "hybrid"}
PROPOSER_ALGORITHM: dict[str, str | None] = {"none": None, "ngram": "NGRAM", "draft_model": "STANDALONE",
                                             "suffix": "SUFFIX", "hybrid": "HYBRID"}
# WorkerSettings field -> SuffixSettings field (the flag is --speculative-suffix-<field with dashes>)
SUFFIX_FIELDS: dict[str, str] = {
    "speculative_suffix_max_tree_depth": "max_tree_depth",
    "speculative_suffix_max_cached_requests": "max_cached_requests",
    "speculative_suffix_max_spec_factor": "max_spec_factor",
    "speculative_suffix_min_token_prob": "min_token_prob",
    "speculative_suffix_max_scopes": "max_scopes",
}
_SUFFIX = SuffixSettings()


def flag(name: str) -> str:
    """A WorkerSettings field's command-line flag (errors name the flag the operator typed)."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    model_dir: Path | None = None  # None: the prepared model (backends/engine/model_store.py)
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "float32"
    max_running_requests: int = 8
    max_total_tokens: int = 65536
    max_queued_requests: int = 64  # beyond this many waiting requests the worker answers 429
    max_batch_tokens: int = 512  # tokens one engine step feeds, all sequences together
    chunked_prefill_size: int = 256  # prompt tokens one sequence feeds per step (SGLang's flag)
    draft_layers: int = 8
    speculative_algorithm: SpeculativeAlgorithm | None = None
    speculative_num_draft_tokens: int = 4
    speculative_adaptive: bool = False
    speculative_adaptive_strategy: str = "beta"  # adaptive.py's controllers
    speculative_num_tokens_per_batch_size: str | None = None  # strategy vllm: "1-3:8,4-15:4,16-4096:0"
    # n-gram lookup: SGLang's flags of the same names (and defaults); match is specgate's
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_match: NgramMatch = "earliest"
    # suffix decoding (backends/engine/proposers/suffix.py); defaults are SuffixSettings' (vLLM's)
    speculative_suffix_max_tree_depth: int = _SUFFIX.max_tree_depth
    speculative_suffix_max_cached_requests: int = _SUFFIX.max_cached_requests
    speculative_suffix_max_spec_factor: float = _SUFFIX.max_spec_factor
    speculative_suffix_min_token_prob: float = _SUFFIX.min_token_prob
    speculative_suffix_max_scopes: int = _SUFFIX.max_scopes
    served_model_name: str | None = None  # default: the model directory's name
    weight_version: str = "default"
    calibrate: bool = True
    num_threads: int | None = None
    # test only (backends/engine/faults.py): the /specgate/fault switch, and the mode the worker starts in
    fault_injection: bool = False
    fault_mode: FaultMode = "off"

    def __post_init__(self) -> None:
        if self.speculative_algorithm is not None and self.speculative_algorithm not in ALGORITHM_PROPOSER:
            raise ValueError(f"speculative_algorithm must be one of {', '.join(ALGORITHM_PROPOSER)} or None, "
                             f"got {self.speculative_algorithm!r}")
        if not 1 <= self.speculative_num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"speculative_num_draft_tokens must be in 1..{MAX_DRAFT_TOKENS}, "
                             f"got {self.speculative_num_draft_tokens}")
        for name in ("max_running_requests", "max_total_tokens", "max_queued_requests", "draft_layers",
                     "max_batch_tokens", "chunked_prefill_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        self._check_ngram()
        self._check_suffix()
        self._check_adaptive()
        self._check_faults()

    def _check_adaptive(self) -> None:
        strategy, table = self.speculative_adaptive_strategy, self.speculative_num_tokens_per_batch_size
        if strategy not in ADAPTIVE_STRATEGIES:
            raise ValueError(f"{flag('speculative_adaptive_strategy')} must be one of "
                             f"{', '.join(ADAPTIVE_STRATEGIES)}, got {strategy!r}")
        if self.speculative_algorithm == "HYBRID" and self.speculative_adaptive and strategy != "beta":
            raise ValueError(f"{flag('speculative_algorithm')} HYBRID picks its source and k with "
                             f"{flag('speculative_adaptive_strategy')} beta, got {strategy}; use beta or another "
                             "algorithm")
        if (strategy == "vllm") != bool(table):
            raise ValueError(f"{flag('speculative_num_tokens_per_batch_size')} goes with "
                             f"{flag('speculative_adaptive_strategy')} vllm, which needs it "
                             "(e.g. 1-3:8,4-15:4,16-4096:0)")
        if table:

            try:
                parse_k_by_batch(table)
            except ValueError as exc:
                raise ValueError(f"{flag('speculative_num_tokens_per_batch_size')}: {exc}") from None

    def _check_faults(self) -> None:
        if self.fault_mode not in FAULT_MODES:
            raise ValueError(f"{flag('fault_mode')} must be one of {', '.join(FAULT_MODES)}, "
                             f"got {self.fault_mode!r}")
        if self.fault_mode != "off" and not self.fault_injection:
            raise ValueError(f"{flag('fault_mode')} {self.fault_mode} needs {flag('fault_injection')} "
                             "(a test switch; without it the worker never injects faults)")
        if self.fault_injection and not is_loopback(self.host):
            raise ValueError(f"{flag('fault_injection')} is a test switch and needs a loopback {flag('host')} "
                             f"(127.0.0.1, ::1 or localhost), got {flag('host')} {self.host}")

    def _check_ngram(self) -> None:
        low, high = "speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size"
        for name in (low, high):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        if getattr(self, low) > getattr(self, high):
            raise ValueError(f"{flag(low)} {getattr(self, low)} is above {flag(high)} {getattr(self, high)}; "
                             "lower the min or raise the max")
        if self.speculative_ngram_match not in NGRAM_MATCHES:
            raise ValueError(f"{flag('speculative_ngram_match')} must be one of {', '.join(NGRAM_MATCHES)}, "
                             f"got {self.speculative_ngram_match!r}")

    def _check_suffix(self) -> None:
        for name in ("speculative_suffix_max_tree_depth", "speculative_suffix_max_cached_requests",
                     "speculative_suffix_max_scopes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        factor = self.speculative_suffix_max_spec_factor
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"{flag('speculative_suffix_max_spec_factor')} must be a number > 0, got {factor}")
        prob = self.speculative_suffix_min_token_prob
        if not 0.0 <= prob <= 1.0:
            raise ValueError(f"{flag('speculative_suffix_min_token_prob')} must be in [0, 1], got {prob}")

    @property
    def default_speculation(self) -> SpeculationParams:
        """The speculation a request gets when it carries no override (the server's launch flags). The n-gram
        settings are in it whatever the algorithm: a request may switch to proposer ngram per request."""
        ngram = dict(ngram_min=self.speculative_ngram_min_match_window_size,
                     ngram_max=self.speculative_ngram_max_match_window_size,
                     ngram_match=self.speculative_ngram_match)
        if self.speculative_algorithm is None:
            return SpeculationParams(proposer="none", draft_tokens=self.speculative_num_draft_tokens, **ngram)
        table = ()
        if self.speculative_num_tokens_per_batch_size:

            table = parse_k_by_batch(self.speculative_num_tokens_per_batch_size)
        return SpeculationParams(proposer=ALGORITHM_PROPOSER[self.speculative_algorithm],  # type: ignore[arg-type]
                                 draft_tokens=self.speculative_num_draft_tokens,
                                 adaptive=self.speculative_adaptive, strategy=self.speculative_adaptive_strategy,
                                 k_by_batch=table, **ngram)

    @property
    def suffix(self) -> SuffixSettings:
        """The suffix proposer's trees (EngineConfig.suffix)."""
        return SuffixSettings(**{engine: getattr(self, name) for name, engine in SUFFIX_FIELDS.items()})

    def speculation_args(self) -> dict[str, object]:
        """The n-gram and suffix server args as /server_info reports them (keys = the flags' field names)."""
        names = ("speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size",
                 "speculative_ngram_match", *SUFFIX_FIELDS)
        return {name: getattr(self, name) for name in names}
