"""Turn raw logits into the distribution a request samples from, identically for target and draft.

Exactness (docs/architecture.md, "The four properties", 2) needs the SAME transformation on p (target) and q (draft) at every
position, each conditioned on its own prefix: position j of a round sees the committed tokens plus drafts
1..j-1, so penalties are computed per position over that history. Order, as in transformers/vLLM:

1. repetition penalty (prompt + output tokens, divide positive / multiply negative logits; HF semantics)
2. frequency and presence penalties (output tokens only; OpenAI semantics: logit -= f*count + p*[count>0])
3. min_new_tokens: stop tokens masked to -inf while the output is shorter than min_new_tokens
4. temperature (greedy: argmax of the penalised logits, nothing else applies)
5. top-k, then top-p (smallest set with cumulative mass >= top_p), then min-p; renormalise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.engine.types import SamplingParams, TokenLogprob


@dataclass(slots=True)
class PenaltyState:
    """Token history a request's penalties depend on; one per sequence, updated as tokens commit."""

    output_counts: torch.Tensor  # [vocab] float, counts of committed output tokens
    seen: torch.Tensor  # [vocab] bool, prompt or output token (repetition penalty)
    output_len: int

    @classmethod
    def create(cls, prompt_ids: list[int] | tuple[int, ...], vocab: int) -> PenaltyState:
        seen = torch.zeros(vocab, dtype=torch.bool)
        if prompt_ids:
            seen[torch.tensor(prompt_ids, dtype=torch.long)] = True
        return cls(torch.zeros(vocab, dtype=torch.float32), seen, 0)

    def commit(self, token_ids: list[int]) -> None:
        for t in token_ids:
            self.output_counts[t] += 1
            self.seen[t] = True
        self.output_len += len(token_ids)


def needs_history(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0 or params.min_new_tokens > 0)


def process_logits(
    logits: torch.Tensor,  # [m, vocab] raw logits for m consecutive positions
    params: SamplingParams,
    state: PenaltyState | None,
    drafts: list[int],  # uncommitted draft tokens; position i has seen drafts[:start + i]
    stop_ids: frozenset[int],
    start: int = 0,
) -> torch.Tensor:
    """Penalised, temperature-scaled logits [m, vocab] (float32). Pure given its inputs.

    The target verifies a round with ``start=0`` over k + 1 positions; the draft model scores its j-th
    draft with ``start=j`` over one position, so both see exactly the same history at every position.
    """
    logits = logits.float()
    if state is None or not needs_history(params):
        return logits if params.greedy else logits / params.temperature
    m, vocab = logits.shape
    steps = torch.zeros(m, vocab, dtype=torch.float32)
    for t in drafts[:start]:
        steps[0, t] += 1.0
    for i in range(1, m):
        steps[i, drafts[start + i - 1]] += 1.0
    counts = state.output_counts.unsqueeze(0) + steps.cumsum(0)  # [m, vocab]
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = state.seen.unsqueeze(0) | (counts > 0)
        rp = params.repetition_penalty
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalised, logits)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    if params.min_new_tokens > 0 and stop_ids:
        stop_index = torch.tensor(sorted(stop_ids), dtype=torch.long)
        for j in range(m):
            if state.output_len + start + j < params.min_new_tokens:
                logits[j, stop_index] = float("-inf")
    return logits if params.greedy else logits / params.temperature


def probs_from_logits(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply top-k, top-p and min-p to temperature-scaled logits [m, vocab]; return probs [m, vocab]."""
    probs = torch.softmax(scaled, dim=-1)
    vocab = probs.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(probs, params.top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_probs.cumsum(-1)
        # keep a token if the mass strictly before it is < top_p (the first token is always kept)
        keep_sorted = (cum - sorted_probs) < params.top_p * cum[..., -1:]
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    if params.min_p > 0.0:
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs >= floor, probs, torch.zeros_like(probs))
    return probs / probs.sum(-1, keepdim=True)


def sample(weights: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one index with probability proportional to ``weights`` [vocab] (non-negative, not necessarily
    normalised) with the request's own generator (never the global RNG), by inverse CDF: one cumulative sum
    and a binary search for a uniform in [0, total). A zero weight is never drawn (its CDF step is empty).
    Exact up to the float cumulative sum's rounding, as ``torch.multinomial``'s own, and cheaper than it over
    a 49,152-token vocabulary (one-off profile, not a rerunnable benchmark: see the issue note)."""
    cdf = torch.cumsum(weights, dim=0)
    u = torch.rand(1, generator=generator, dtype=cdf.dtype) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), weights.shape[0] - 1)


def token_logprobs(scaled: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Log-probabilities of ``tokens`` at consecutive positions of ``scaled`` ([>= len(tokens), vocab],
    the output of :func:`process_logits`), each with the ``top`` most likely tokens of its position."""
    n = len(tokens)
    logp = torch.log_softmax(scaled[:n], dim=-1)
    chosen = logp[torch.arange(n), torch.tensor(tokens, dtype=torch.long)].tolist()
    if not top:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = torch.topk(logp, top, dim=-1)
    return [TokenLogprob(t, lp, tuple(zip(i, v)))
            for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]
