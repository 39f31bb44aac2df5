"""The speculation vocabulary, defined once: the proposer names, the draft-length bound, the per-round
controllers' names and vLLM's per-batch-size k table. The policy (``policies/``), the worker and the engine
(``backends/``), replay and telemetry import these names from here, so a new proposer or a wider k is one edit.

Words (docs/architecture.md, "Vocabulary"): per round a proposer drafts k tokens, the target accepts a prefix
of them and adds one token of its own; k = 0 (proposer ``none``) is plain decoding.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

# What the embedded engine runs (``custom_params.speculation.proposer``, ``SpeculationParams.proposer``).
# ``hybrid`` drafts from n-gram and suffix every round and picks the source per round (backends/engine/source_choice.py)
Proposer = Literal["none", "ngram", "draft_model", "suffix", "hybrid"]
PROPOSERS: tuple[str, ...] = ("none", "ngram", "draft_model", "suffix", "hybrid")
# What a policy's pool may name: the engine's proposers and those only SGLang servers run (``eagle``,
# ``eagle3``, ``standalone``: a separate draft model), each pool being one server configuration.
PoolProposer = Literal["none", "ngram", "suffix", "hybrid", "draft_model", "eagle", "eagle3", "standalone"]
POOL_PROPOSERS: tuple[str, ...] = ("none", "ngram", "suffix", "hybrid", "draft_model", "eagle", "eagle3", "standalone")
MODEL_FREE: frozenset[str] = frozenset({"ngram", "suffix", "hybrid"})  # drafts follow from the ids alone (replay is exact)
NgramMatch = Literal["earliest", "latest"]
NGRAM_MATCHES: tuple[str, ...] = ("earliest", "latest")
# The per-round controllers (backends/engine/adaptive.py, baselines.py): specgate's, SGLang's --speculative-adaptive,
# vLLM's table
ADAPTIVE_STRATEGIES: tuple[str, ...] = ("beta", "sglang", "vllm")
MAX_DRAFT_TOKENS = 16  # the most drafts one round may verify (k), per request and per round
SCOPE_MAX_CHARS = 128  # ``custom_params.speculation.scope``: whose earlier outputs suffix decoding drafts from


Strategy = Literal["beta", "sglang", "vllm"]


class SpeculationOverride(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True,
                          omit_defaults=True):
    """``custom_params.speculation``: one request's speculation, sent by the gateway (``policies/decide.py``
    builds it from the policy, ``gateway/dispatch.py`` adds the route's ``scope``) and decoded by the worker
    (``backends/worker/translate.py`` merges it over the launch default). A real SGLang server ignores it.

    A field left out keeps the worker's launch default. ``scope`` (suffix decoding): whose earlier outputs the
    suffix proposer may draft from; the gateway sends the route's name. The n-gram and suffix settings are
    server settings (launch flags, part of the pair version), never per request. ``strategy``/``k_by_batch``/
    ``prior``: backends/engine/adaptive.py. Shapes are checked by msgspec on decoding; ``problem`` adds the
    checks a type cannot say, with the field to name.
    """

    proposer: Proposer | None = None
    draft_tokens: Annotated[int, Meta(ge=1, le=MAX_DRAFT_TOKENS)] | None = None
    adaptive: bool | None = None
    strategy: Strategy | None = None
    k_by_batch: Annotated[list[tuple[Annotated[int, Meta(ge=1)], Annotated[int, Meta(ge=0, le=MAX_DRAFT_TOKENS)]]],
                          Meta(max_length=64)] | None = None
    prior: Annotated[list[Annotated[float, Meta(ge=0.0, le=1.0)]], Meta(max_length=MAX_DRAFT_TOKENS)] | None = None
    scope: str | None = None

    def problem(self) -> tuple[str, str] | None:
        """(field, what is wrong and what to send) for the first value no type can rule out, else None."""
        if self.scope is not None and len(self.scope) > SCOPE_MAX_CHARS:
            return "scope", (f"must be at most {SCOPE_MAX_CHARS} characters, got {len(self.scope)}; send a "
                             "shorter name (the gateway sends the route's name)")
        table = [tuple(pair) for pair in self.k_by_batch or ()]
        if table != sorted(table) or len({lo for lo, _ in table}) != len(table):
            return "k_by_batch", ("must list [lowest batch size, k] pairs in ascending order of batch size, "
                                  "each size once, e.g. [[1, 8], [4, 4], [16, 0]]")
        return None


PLAIN_OVERRIDE = SpeculationOverride(proposer="none")  # a per-request worker told not to speculate


def parse_k_by_batch(text: str) -> tuple[tuple[int, int], ...]:
    """vLLM's schedule written ``"1-3:8,4-15:4,16-4096:0"`` (inclusive ranges, ``LO-HI:K`` or ``LO:K``) as
    ascending (lowest batch size, k) pairs."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        span, sep, k = item.partition(":")
        lo = span.split("-")[0]
        if not sep or not lo.isdigit() or not k.isdigit() or int(lo) < 1:
            raise ValueError(f"k_by_batch: {item!r} is not LO-HI:K or LO:K (batch sizes >= 1, k >= 0), "
                             "e.g. 1-3:8,4-15:4,16-4096:0")
        pairs.append((int(lo), int(k)))
    if not pairs:
        raise ValueError("k_by_batch is empty; write ranges like 1-3:8,4-15:4,16-4096:0")
    return tuple(sorted(pairs))
