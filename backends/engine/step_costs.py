"""The engine's step-cost model: measured seconds of a target forward by what it holds (sequences, tokens).

The per-round controllers (adaptive.py) price a round of k drafts as the step it joins, and the worker's plain
counterfactual (``plain_share``) scales a measured step to the step without a round's drafts; ``/server_info``
reports the table (``specgate_step_costs``, with the draft and overhead costs and the calibration's context,
which ``policies.live_costs.from_server_info`` turns into a replay cost model) and ``startup_costs.measure_steps``
fills it at start-up.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import isotonic_regression


def centered(tokens: Sequence[int], seconds: Sequence[float]) -> list[float]:
    """Centered isotonic regression (Oron & Flournoy 2017) of ``seconds`` measured at the ascending ``tokens``, read
    at ``tokens``: SciPy's least-squares non-decreasing fit, each run of equal fitted values replaced by the line
    between its neighbours' centres (mean tokens, value), flat only inside the first and last run. The plain fit
    pools a noisy dip into a flat run, where a wider forward costs nothing more and the rule drafts through it
    (docs/runs/2026-12-07-centered-fit); replay's ``policies.measured.centered_fit`` is the same fit."""
    fitted = isotonic_regression(seconds).x.tolist()
    knots: list[tuple[float, float]] = []  # (a run's mean tokens, its value); a few dozen entries: plain Python
    start = 0
    for i in range(1, len(fitted) + 1):
        if i == len(fitted) or fitted[i] != fitted[start]:
            knots.append((sum(tokens[start:i]) / (i - start), fitted[start]))
            start = i
    if len(knots) == 1:
        return fitted
    xs, ys = zip(*knots)
    return np.interp(tokens, xs, ys).tolist()


@dataclass(slots=True)
class StepCosts:
    """Engine-wide EMA of measured seconds per target forward by what it holds (sequences, tokens): one
    sequence's round or a whole batched step, per draft token, and per round's overhead (sampling,
    verification, commit). Within a sequence count, cost grows with tokens (rows of every GEMM); each
    sequence adds its own attention calls.

    Lookups read, per sequence count, the centred isotonic (non-decreasing in tokens) fit of the measured seconds
    (:func:`centered`), so a noisy entry never makes a wider forward look cheaper than, or as cheap as, a narrower
    one: the per-round rule picks k by these differences. On the 2-core EPYC the raw table priced 12 tokens of
    4 sequences below 8 (45.2 against 46.5 ms), which drew 8-draft rounds (docs/runs/2026-12-07-step-cost-fit);
    the plain isotonic fit then priced both at 45.85 ms, so 4 more drafts looked free
    (docs/runs/2026-12-07-centered-fit).
    :meth:`table` (``/server_info``) reports the measurements, which replay on a worker's live costs reads through
    the same fit, so it prices the same.

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
    _curves: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict, repr=False)  # count -> fit
    _groups: dict[int, int] = field(default_factory=dict, repr=False)  # sequences -> nearest measured count

    def observe_forward(self, tokens: int, seconds: float, seqs: int = 1) -> None:
        old = self.forward_s.get((seqs, tokens))
        self.forward_s[seqs, tokens] = seconds if old is None else (1 - self.beta) * old + self.beta * seconds
        self._curves.pop(seqs, None)
        if old is None:
            self._groups.clear()

    def restore(self, table: dict[tuple[int, int], float]) -> None:
        """Replace the forward table (the start-up calibration puts back its own after timing the overhead)."""
        self.forward_s = dict(table)
        self._curves.clear()
        self._groups.clear()

    def observe_draft(self, proposer: str, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        per = seconds / tokens
        old = self.draft_token_s.get(proposer)
        self.draft_token_s[proposer] = per if old is None else (1 - self.beta) * old + self.beta * per

    def observe_overhead(self, seconds: float) -> None:
        self.overhead_s = seconds if not self.overhead_s else (1 - self.beta) * self.overhead_s + self.beta * seconds

    def forward(self, tokens: int, seqs: int = 1) -> float:
        """Seconds of a forward of ``tokens`` tokens over ``seqs`` sequences, from the nearest measured sequence
        count's fit: linear between measured token counts, the smallest's value below them, proportional above."""
        if not self.forward_s:
            return float(tokens)  # uncalibrated: cost proportional to tokens
        group = self._groups.get(seqs)
        if group is None:
            group = self._groups[seqs] = min({n for n, _ in self.forward_s}, key=lambda n: (abs(n - seqs), -n))
        ts, vs = self._curves.get(group) or self._fit(group)
        i = bisect_left(ts, tokens)
        if i < len(ts) and ts[i] == tokens:
            return vs[i]
        if i == 0:
            return vs[0]
        if i == len(ts):
            return vs[-1] * tokens / ts[-1]
        share = (tokens - ts[i - 1]) / (ts[i] - ts[i - 1])
        return vs[i - 1] + share * (vs[i] - vs[i - 1])

    def _fit(self, group: int) -> tuple[list[int], list[float]]:
        measured = sorted((t, s) for (n, t), s in self.forward_s.items() if n == group)
        tokens = [t for t, _ in measured]
        fit = (tokens, centered(tokens, [s for _, s in measured]))
        self._curves[group] = fit
        return fit

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
        """(sequences, tokens, seconds) of every forward measured (the EMA), ascending: what /server_info reports.
        The measurements, not the fit: every reader fits them once, as :meth:`forward` does (replay's cost model,
        ``policies.costmodel.Grid``; the gateway's counterfactuals through it), and so prices as this engine's rule
        does. The centred fit of a fit is not the fit (a flat first run of three or more counts is read again as
        rising), so a reported fit would have been priced a little apart."""
        return sorted((n, t, s) for (n, t), s in self.forward_s.items())
