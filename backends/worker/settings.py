"""What `specgate worker` is started with: the engine's configuration plus the server's identity.

The speculative defaults mirror SGLang's server flags (``--speculative-algorithm``,
``--speculative-num-draft-tokens``, ``--speculative-adaptive``): a request without a
``custom_params.speculation`` override runs exactly as it would on an SGLang server launched with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from backends.engine.types import MAX_DRAFT_TOKENS, SpeculationParams

SpeculativeAlgorithm = Literal["NGRAM", "STANDALONE"]
# SGLang's algorithm name -> the engine's proposer (STANDALONE = a separate draft model; ours is the
# layer-truncated self-draft).
ALGORITHM_PROPOSER: dict[str, str] = {"NGRAM": "ngram", "STANDALONE": "draft_model"}
PROPOSER_ALGORITHM: dict[str, str | None] = {"none": None, "ngram": "NGRAM", "draft_model": "STANDALONE"}


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    model_dir: Path | None = None  # None: the prepared model (backends/engine/model_store.py)
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "float32"
    max_running_requests: int = 8
    max_total_tokens: int = 65536
    max_queued_requests: int = 64  # beyond this many waiting requests the worker answers 429
    draft_layers: int = 8
    speculative_algorithm: SpeculativeAlgorithm | None = None
    speculative_num_draft_tokens: int = 4
    speculative_adaptive: bool = False
    served_model_name: str | None = None  # default: the model directory's name
    weight_version: str = "default"
    calibrate: bool = True
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.speculative_algorithm is not None and self.speculative_algorithm not in ALGORITHM_PROPOSER:
            raise ValueError(f"speculative_algorithm must be one of {', '.join(ALGORITHM_PROPOSER)} or None, "
                             f"got {self.speculative_algorithm!r}")
        if not 1 <= self.speculative_num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"speculative_num_draft_tokens must be in 1..{MAX_DRAFT_TOKENS}, "
                             f"got {self.speculative_num_draft_tokens}")
        for name in ("max_running_requests", "max_total_tokens", "max_queued_requests", "draft_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")

    @property
    def default_speculation(self) -> SpeculationParams:
        """The speculation a request gets when it carries no override (the server's launch flags)."""
        if self.speculative_algorithm is None:
            return SpeculationParams(proposer="none", draft_tokens=self.speculative_num_draft_tokens)
        return SpeculationParams(proposer=ALGORITHM_PROPOSER[self.speculative_algorithm],  # type: ignore[arg-type]
                                 draft_tokens=self.speculative_num_draft_tokens,
                                 adaptive=self.speculative_adaptive)
