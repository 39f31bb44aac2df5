"""SGLang's and vLLM's per-round draft-length controllers, reproduced in specgate's engine so that replay and the
serving benchmark measure specgate's own (``beta``, backends/engine/adaptive.py) against them on the same rounds.
Same interface: ``choose(batch, context, cap)``, ``observe(proposed, accepted, context)``, ``end_step()``.

``sglang`` (:class:`SglangAdaptive`, engine-wide per proposer): SGLang's ``--speculative-adaptive``, as
``python/sglang/srt/speculative/adaptive_spec_params.py`` implements it (sgl-project/sglang#21599; #24055 adds
per-batch-size slots, whose default for batch sizes 1-63 is the same): an EMA (alpha 0.2) of the batch's mean
accepted drafts per request; after ``warmup_batches`` 10, every ``update_interval`` 5 batches, steps move down
while ema <= prev - 0.5 + down_hysteresis (-0.25) and up while ema > cur - 0.5 + up_hysteresis (0.0), among
candidate steps {1, 3, 7} plus the initial one (the request's draft_tokens); the EMA starts at steps - 1.
It never serves k = 0.

``vllm`` (:class:`VllmDynamic`, stateless): vLLM's dynamic speculative decoding,
``num_speculative_tokens_per_batch_size`` (vllm-project/vllm#32374): k looked up from the batch size in a
configured table of inclusive ranges, gaps inheriting the previous range's k, clamped to
``num_speculative_tokens`` (here draft_tokens); ``SpeculationParams.k_by_batch`` holds it as (lowest batch
size, k) pairs. Batch sizes below the first entry use draft_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SGLANG_CANDIDATES = (1, 3, 7)


@dataclass(slots=True)
class SglangAdaptive:
    """SGLang's ``--speculative-adaptive`` controller, shared by the sequences of one engine (module
    docstring); defaults are SGLang's."""

    k_max: int
    candidates: tuple[int, ...] = SGLANG_CANDIDATES
    ema_alpha: float = 0.2
    update_interval: int = 5
    warmup_batches: int = 10
    down_hysteresis: float = -0.25
    up_hysteresis: float = 0.0
    steps: list[int] = field(default_factory=list)
    current: int = 0
    ema: float = 0.0
    batches: int = 0
    pending: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.steps = sorted(set(self.candidates) | {self.k_max})
        self.current = self.k_max  # SGLang starts at the server's speculative_num_steps
        self.ema = float(self.current - 1)

    def choose(self, batch: int = 1, context: int = 0, cap: int | None = None) -> int:
        return self.current if cap is None else min(self.current, cap)

    def observe(self, proposed: int, accepted: int, context: int = 0) -> None:
        self.pending.append(accepted)

    def end_step(self) -> None:
        """One verify batch: the EMA of its mean accepted drafts, then (past warm-up, every interval) the
        step moves by the hysteresis thresholds."""
        if not self.pending:
            return
        mean = sum(self.pending) / len(self.pending)
        self.pending.clear()
        self.ema = (1 - self.ema_alpha) * self.ema + self.ema_alpha * mean
        self.batches += 1
        if self.batches <= self.warmup_batches or (self.batches - self.warmup_batches) % self.update_interval:
            return
        i = self.steps.index(self.current)
        while i > 0 and self.ema <= self.steps[i - 1] - 0.5 + self.down_hysteresis:
            i -= 1
        while i < len(self.steps) - 1 and self.ema > self.steps[i] - 0.5 + self.up_hysteresis:
            i += 1
        self.current = self.steps[i]


@dataclass(slots=True)
class VllmDynamic:
    """vLLM's per-batch-size draft length table (module docstring)."""

    k_max: int
    table: tuple[tuple[int, int], ...] = ()

    def choose(self, batch: int = 1, context: int = 0, cap: int | None = None) -> int:
        k = self.k_max
        for lowest, value in self.table:
            if batch >= lowest:
                k = value
        return min(k, self.k_max, self.k_max if cap is None else cap)

    def observe(self, proposed: int, accepted: int, context: int = 0) -> None:
        pass

    def end_step(self) -> None:
        pass
