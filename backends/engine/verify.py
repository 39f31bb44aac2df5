"""Exact verification of a round of drafts: a pure function (CONTRIBUTING.md #2).

Notation (docs/architecture.md, "Vocabulary"): p = target, q = draft. For draft token x_j at position j:
- greedy: accept while x_j == argmax p_j; the extra token is argmax p_n at the first mismatch (or the
  bonus argmax p_k). This is token identity with plain greedy decoding.
- sampling (Leviathan et al. 2023; Chen et al. 2023): accept x_j with probability min(1, p_j(x)/q_j(x));
  on the first rejection draw the *recovered* token from the normalised residual max(p_j - q_j, 0);
  if all k are accepted draw the *bonus* token from p_k. The committed tokens are then distributed
  exactly as if sampled from p one at a time.
- A deterministic proposer (n-gram lookup) has q = one-hot(x_j): accept with probability p_j(x_j); the
  residual is p_j with x_j removed, renormalised. ``draft_probs=None`` means exactly that.

Randomness comes only from the passed-in generator; ``uniforms`` may be injected for golden tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.engine.sampling import sample


@dataclass(frozen=True, slots=True)
class Verdict:
    accepted: int  # n: drafts accepted, 0 <= n <= k
    tokens: list[int]  # the n accepted drafts followed by the recovered or bonus token (n + 1 ids)
    bonus: bool  # n == k: the extra token came from p_k


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, token: int) -> torch.Tensor:
    """Normalised max(p - q, 0) for one position ([vocab]); q = one-hot(token) when draft_probs is None."""
    if draft_probs is None:
        res = target_probs.clone()
        res[token] = 0.0
    else:
        res = torch.clamp(target_probs - draft_probs, min=0.0)
    total = res.sum()
    if total <= 0:  # p == q exactly: rejection has probability 0, any choice keeps exactness
        return target_probs
    return res / total


def verify_greedy(
    target_logits: torch.Tensor,  # [k + 1, vocab], processed logits (argmax is all that matters)
    draft_tokens: list[int],  # [k]
) -> Verdict:
    choice = target_logits.argmax(dim=-1).tolist()  # one tolist: no per-position tensor round-trips
    k = len(draft_tokens)
    n = 0
    while n < k and draft_tokens[n] == choice[n]:
        n += 1
    return Verdict(accepted=n, tokens=draft_tokens[:n] + [choice[n]], bonus=n == k)


def verify_sampled(
    target_probs: torch.Tensor,  # [k + 1, vocab]
    draft_probs: torch.Tensor | None,  # [k, vocab], or None for a deterministic proposer
    draft_tokens: list[int],  # [k]
    generator: torch.Generator,
    uniforms: list[float] | None = None,  # [k] injected acceptance uniforms (tests only)
) -> Verdict:
    k = len(draft_tokens)
    if k:
        index = torch.arange(k)
        drafts = torch.tensor(draft_tokens, dtype=torch.long)
        p_x = target_probs[index, drafts]
        q_x = torch.ones(k) if draft_probs is None else draft_probs[index, drafts]
        ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(1e-30), torch.zeros_like(p_x)).clamp(max=1.0)
        u = torch.tensor(uniforms) if uniforms is not None else torch.rand(k, generator=generator)
        rejected = (u >= ratio).tolist()  # accept iff u < min(1, p/q)
    else:
        rejected = []
    for j in range(k):
        if rejected[j]:
            q_j = None if draft_probs is None else draft_probs[j]
            recovered = sample(residual(target_probs[j], q_j, draft_tokens[j]), generator)
            return Verdict(accepted=j, tokens=draft_tokens[:j] + [recovered], bonus=False)
    bonus = sample(target_probs[k], generator)
    return Verdict(accepted=k, tokens=list(draft_tokens) + [bonus], bonus=True)
