"""Adaptive draft length: pick k per round from observed acceptance and measured step costs.

Per sequence we keep an exponential moving average of the conditional acceptance of each draft
position, a_j = P(draft j accepted | drafts 1..j-1 accepted). After a round that proposed k' drafts
and accepted n, every reached position j <= min(k', n + 1) is updated:

    a_j <- (1 - beta) * a_j + beta * [j <= n]

(positions after the first rejection were not reached and keep their estimate). The expected tokens
committed by a round of k drafts is E[P](k) = 1 + sum_{j<=k} prod_{i<=j} a_i, and its cost is the
measured target forward time of width k + 1 plus k draft steps. The controller picks

    k* = argmax_{0 <= k <= k_max}  E[P](k) / (t_forward(k + 1) + k * t_draft)

so k* = 0 (a plain step) whenever speculation is predicted to lose. No constant-acceptance assumption:
each position has its own estimate. While k* = 0 the estimates cannot move, so every ``probe_every``-th
consecutive plain round proposes one draft to keep them fresh (a bounded, known exploration cost).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StepCosts:
    """Engine-wide EMA of measured seconds per target forward width and per draft token.

    Widths never measured fall back to the nearest measured width, scaled linearly (a safe guess that
    over-estimates wide verification on this CPU).
    """

    forward_s: dict[int, float] = field(default_factory=dict)
    draft_token_s: dict[str, float] = field(default_factory=dict)
    beta: float = 0.1

    def observe_forward(self, width: int, seconds: float) -> None:
        old = self.forward_s.get(width)
        self.forward_s[width] = seconds if old is None else (1 - self.beta) * old + self.beta * seconds

    def observe_draft(self, proposer: str, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        per = seconds / tokens
        old = self.draft_token_s.get(proposer)
        self.draft_token_s[proposer] = per if old is None else (1 - self.beta) * old + self.beta * per

    def forward(self, width: int) -> float:
        if width in self.forward_s:
            return self.forward_s[width]
        if not self.forward_s:
            return float(width)  # uncalibrated: cost proportional to width
        nearest = min(self.forward_s, key=lambda w: abs(w - width))
        return self.forward_s[nearest] * max(1.0, width / nearest)


@dataclass(slots=True)
class AdaptiveDraftLength:
    k_max: int
    proposer: str
    costs: StepCosts
    prior: float = 0.5
    beta: float = 0.25
    probe_every: int = 8
    accept: list[float] = field(default_factory=list)  # a_1..a_kmax
    plain_streak: int = 0

    def __post_init__(self) -> None:
        if not self.accept:
            self.accept = [self.prior] * self.k_max

    def expected_tokens(self, k: int) -> float:
        """E[P](k) = 1 + sum_{j<=k} prod_{i<=j} a_i."""
        total, survive = 1.0, 1.0
        for j in range(k):
            survive *= self.accept[j]
            total += survive
        return total

    def choose(self) -> int:
        draft_s = self.costs.draft_token_s.get(self.proposer, 0.0)
        best_k, best_rate = 0, 1.0 / self.costs.forward(1)
        for k in range(1, self.k_max + 1):
            rate = self.expected_tokens(k) / (self.costs.forward(k + 1) + k * draft_s)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0:
            self.plain_streak += 1
            if self.plain_streak >= self.probe_every:
                self.plain_streak = 0
                return 1
        else:
            self.plain_streak = 0
        return best_k

    def observe(self, proposed: int, accepted: int) -> None:
        for j in range(min(proposed, accepted + 1)):
            hit = 1.0 if j < accepted else 0.0
            self.accept[j] = (1 - self.beta) * self.accept[j] + self.beta * hit
