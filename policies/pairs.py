"""A target-draft pair, the versioned artifact a speculative pool serves: its identity and version hash
(re-exported by :mod:`policies.schema`, where the policy file's ``pairs:`` section uses it)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Literal

import msgspec

from policies.schema_base import Name, PosInt, _Strict  # noqa: F401  (Name: re-exported)


class ModelId(_Strict, kw_only=True):
    model: str
    revision: str | None = None
    weight_version: str | None = None


DraftKind = Literal["ngram", "suffix", "layer_truncated", "model", "eagle", "eagle3"]
ParamValue = str | int | float | bool


def _window(value: ParamValue) -> str | None:
    return None if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else "an int >= 1"


def _number(value: ParamValue) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _positive(value: ParamValue) -> str | None:
    number = _number(value)
    return None if number is not None and 0 < number < float("inf") else "a number > 0"


def _probability(value: ParamValue) -> str | None:
    number = _number(value)
    return None if number is not None and 0 <= number <= 1 else "a number in [0, 1]"


def _match(value: ParamValue) -> str | None:
    return None if value in ("earliest", "latest") else "earliest or latest"


# The draft settings a kind accepts in ``params`` and what each must be (a check returns None when the value
# is fine, else what it should be). They are the worker's launch flags that change acceptance: ngram's are
# SGLang's --speculative-ngram-{min,max}-match-window-size (+ specgate's --speculative-ngram-match, and
# --speculative-num-draft-tokens, which SGLang server deployments pin here), suffix's the embedded worker's
# --speculative-suffix-* flags. Kinds not listed take free-form params (e.g. EAGLE's num_steps, eagle_topk).
DRAFT_PARAMS: dict[str, dict[str, Callable[[ParamValue], str | None]]] = {
    "ngram": {"min_match_window_size": _window, "max_match_window_size": _window, "match": _match,
              "num_draft_tokens": _window},
    "suffix": {"max_tree_depth": _window, "max_cached_requests": _window, "max_spec_factor": _positive,
               "min_token_prob": _probability, "max_scopes": _window},
}


class DraftId(_Strict, kw_only=True):
    """The draft side of a pair. ``layer_truncated`` = the target's first ``layers`` layers; ``params`` holds
    algorithm settings that change acceptance (n-gram window, suffix tree bounds, EAGLE top-k) and so belong
    to the version; for ``ngram`` and ``suffix`` they are checked against ``DRAFT_PARAMS`` and compared
    with what the workers report (``backends/sglang/pair.py``)."""

    kind: DraftKind
    model: str | None = None
    revision: str | None = None
    weight_version: str | None = None
    layers: PosInt | None = None
    params: dict[str, ParamValue] = {}

    def __post_init__(self) -> None:
        if self.kind == "layer_truncated" and self.layers is None:
            raise ValueError("kind layer_truncated needs layers (how many target layers the draft keeps)")
        if self.kind in ("model", "eagle", "eagle3") and self.model is None:
            raise ValueError(f"kind {self.kind} needs model (the draft weights' name)")
        allowed = DRAFT_PARAMS.get(self.kind)
        if allowed is None:
            return
        for key, value in self.params.items():
            if key not in allowed:
                raise ValueError(f"kind {self.kind} has no param {key!r}; allowed: {', '.join(allowed)}")
            wanted = allowed[key](value)
            if wanted is not None:
                raise ValueError(f"param {key} must be {wanted}, got {value!r}")
        low, high = self.params.get("min_match_window_size"), self.params.get("max_match_window_size")
        if low is not None and high is not None and low > high:  # type: ignore[operator]
            raise ValueError(f"param min_match_window_size {low} > max_match_window_size {high}; swap them")


class Pair(_Strict, kw_only=True):
    """A target-draft pair is ONE versioned artifact: any identity change is a new version."""

    target: ModelId
    draft: DraftId

    @property
    def version(self) -> str:
        """Short sha256 of the canonical identity; statistics are keyed by it, so a change resets them."""
        return pair_version(self)


def pair_version(pair: Pair) -> str:
    return hashlib.sha256(msgspec.json.encode(pair, order="sorted")).hexdigest()[:12]
