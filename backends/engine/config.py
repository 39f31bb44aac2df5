"""Engine settings (what `specgate worker` flags set)."""

from __future__ import annotations

from dataclasses import dataclass

from backends.engine.types import SpeculationParams, SuffixSettings


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_path: str
    dtype: str = "float32"  # "float32" (exact greedy identity) or "bfloat16" (see docs/engine.md)
    max_running_requests: int = 16
    max_total_tokens: int = 65536  # KV capacity in positions, shared by running sequences
    max_waiting_requests: int = 1024
    prefill_chunk: int = 256  # prompt tokens one sequence feeds per step (bounds others' stall)
    max_batch_tokens: int = 512  # tokens one step feeds, all sequences together (rounds first, then prefill)
    draft_layers: int = 8  # layer-truncated self-draft depth
    default_speculation: SpeculationParams = SpeculationParams()
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    calibrate: bool = True  # measure forward time per width at start (feeds adaptive k)
    suffix: SuffixSettings = SuffixSettings()  # the suffix proposer's trees (backends/engine/proposers/suffix.py)
