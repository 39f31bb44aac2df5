"""The engine's step-cost model: measured seconds of a target forward by what it holds (sequences, tokens).

The per-round controllers (adaptive.py) price a round of k drafts as the step it joins, and the worker's plain
counterfactual (``plain_share``) scales a measured step to the step without a round's drafts; ``/server_info``
reports the table (``specgate_step_costs``, with the draft and overhead costs and the calibration's context,
which ``policies.live_costs.from_server_info`` turns into a replay cost model) and ``startup_costs.measure_steps``
fills it at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StepCosts:
    """Engine-wide EMA of measured seconds per target forward by what it holds (sequences, tokens): one
    sequence's round or a whole batched step, per draft token, and per round's overhead (sampling,
    verification, commit). Within a sequence count, cost grows with tokens (rows of every GEMM); each
    sequence adds its own attention calls.

    ``step_seqs`` / ``step_base``: the sequences of the step being planned and the tokens the others feed;
    a round of k drafts then costs ``forward(step_base + k + 1, step_seqs)``, the step every sequence in it
    waits for (at c1: 1 and 0). Unmeasured token counts interpolate linearly between measured ones of the
    nearest measured sequence count (beyond the largest: proportional).

    ``context``: the tokens cached before the start-up calibration's forwards (``measure_steps``), None when the
    engine did not calibrate; live steps then refine each shape at whatever context they ran at.
    """

    forward_s: dict[tuple[int, int], float] = field(default_factory=dict)  # (sequences, tokens) -> seconds
    draft_token_s: dict[str, float] = field(default_factory=dict)
    overhead_s: float = 0.0
    context: int | None = None
    beta: float = 0.1
    step_seqs: int = 1
    step_base: int = 0

    def observe_forward(self, tokens: int, seconds: float, seqs: int = 1) -> None:
        old = self.forward_s.get((seqs, tokens))
        self.forward_s[seqs, tokens] = seconds if old is None else (1 - self.beta) * old + self.beta * seconds

    def observe_draft(self, proposer: str, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        per = seconds / tokens
        old = self.draft_token_s.get(proposer)
        self.draft_token_s[proposer] = per if old is None else (1 - self.beta) * old + self.beta * per

    def observe_overhead(self, seconds: float) -> None:
        self.overhead_s = seconds if not self.overhead_s else (1 - self.beta) * self.overhead_s + self.beta * seconds

    def forward(self, tokens: int, seqs: int = 1) -> float:
        if not self.forward_s:
            return float(tokens)  # uncalibrated: cost proportional to tokens
        counts = {n for n, _ in self.forward_s}
        group = min(counts, key=lambda n: (abs(n - seqs), -n))
        known = {t: s for (n, t), s in self.forward_s.items() if n == group}
        if tokens in known:
            return known[tokens]
        below = max((t for t in known if t < tokens), default=None)
        above = min((t for t in known if t > tokens), default=None)
        if below is None:
            return known[above]
        if above is None:
            return known[below] * tokens / below
        share = (tokens - below) / (above - below)
        return known[below] + share * (known[above] - known[below])

    def plain_share(self, tokens: int, seqs: int, k: int) -> float:
        """The share of a step of ``tokens`` tokens and ``seqs`` sequences left without one round's ``k`` drafts
        (<= 1): what a measured step is scaled by for that round's plain counterfactual (a ratio, so a model
        measured on other steps never takes away more than the step took)."""
        whole = self.forward(tokens, seqs)
        return min(1.0, self.forward(tokens - k, seqs) / whole) if k and whole > 0 else 1.0

    def round_s(self, proposer: str, k: int) -> float:
        """Seconds of a round of k drafts (k = 0: a plain step) in the step being planned."""
        draft = k * self.draft_token_s.get(proposer, 0.0) if k else 0.0
        return self.forward(self.step_base + k + 1, self.step_seqs) + draft + self.overhead_s

    def table(self) -> list[tuple[int, int, float]]:
        """(sequences, tokens, seconds) of every forward measured, ascending (what /server_info reports)."""
        return [(n, t, s) for (n, t), s in sorted(self.forward_s.items())]
