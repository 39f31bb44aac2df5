"""Target-draft pair identity: what a worker says it serves, compared with what the policy declares.

A pair is one versioned artifact (docs/architecture.md, "Vocabulary"): the target (model_path, revision, weight_version), the
draft (path, revision), the speculative algorithm and its draft-token count. A worker reports these in
``/server_info`` (server args) and ``/model_info`` (weight_version). Only the fields the policy
declares are verified; an undeclared field is not compared.

specgate's embedded worker reports ``specgate_per_request_speculation: true``: it applies the
algorithm and draft length each request asks for in ``custom_params.speculation``, so for such a
worker the algorithm and draft tokens always match what the gateway will send; the target and draft
identity are still verified, and so are the declared draft params (n-gram window, suffix tree bounds):
those are launch flags even on that worker, never per request.
"""

from __future__ import annotations

import msgspec

from backends.sglang.wire import ModelInfo, ServerInfo


ParamValue = str | int | float | bool
# A policy draft param (``pairs.<name>.draft.params``) -> the ``/server_info`` server arg reporting it.
# ngram's window sizes are SGLang's NGRAM args too; the rest only specgate's embedded worker reports.
DRAFT_PARAM_ARGS: dict[str, str] = {
    "min_match_window_size": "speculative_ngram_min_match_window_size",
    "max_match_window_size": "speculative_ngram_max_match_window_size",
    "match": "speculative_ngram_match",
    "max_tree_depth": "speculative_suffix_max_tree_depth",
    "max_cached_requests": "speculative_suffix_max_cached_requests",
    "max_spec_factor": "speculative_suffix_max_spec_factor",
    "min_token_prob": "speculative_suffix_min_token_prob",
    "max_scopes": "speculative_suffix_max_scopes",
}


class _PairFields(msgspec.Struct, frozen=True, kw_only=True):
    """The identity of a (target, draft) pair as SGLang's ``/server_info`` and ``/model_info`` give it."""

    target_model_path: str | None = None
    target_revision: str | None = None
    target_weight_version: str | None = None
    draft_model_path: str | None = None
    draft_revision: str | None = None
    algorithm: str | None = None
    draft_tokens: int | None = None
    # (param, value) sorted by param: a tuple, so the Struct stays hashable (the gateway compares topologies)
    draft_params: tuple[tuple[str, ParamValue], ...] = ()


class ExpectedPair(_PairFields, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What the policy declares for a pool. ``None`` = not declared, not checked.

    ``algorithm``: SGLang's ``speculative_algorithm`` (``NGRAM``, ``EAGLE3``, ``STANDALONE``...,
    compared case-insensitively) or ``"none"`` for a plain pool. ``draft_params``: the declared draft
    params that a worker reports (keys of ``DRAFT_PARAM_ARGS``); only those are compared.
    """


class PairIdentity(_PairFields, frozen=True, kw_only=True):
    """What one worker reports. ``algorithm`` is None for a worker without speculation; ``draft_params``
    holds every ``DRAFT_PARAM_ARGS`` param the worker reports (an SGLang server: the n-gram windows)."""

    per_request_speculation: bool = False

    @classmethod
    def from_info(cls, server: ServerInfo, model: ModelInfo | None) -> PairIdentity:
        """``/model_info`` wins for weight_version (it follows weight updates); the rest from args."""
        weight_version = (model.weight_version if model and model.weight_version is not None
                          else server.weight_version)
        return cls(
            target_model_path=server.model_path or (model.model_path if model else None),
            target_revision=server.revision,
            target_weight_version=weight_version,
            draft_model_path=server.speculative_draft_model_path,
            draft_revision=server.speculative_draft_model_revision,
            algorithm=_algorithm(server.speculative_algorithm),
            draft_tokens=_drafted_per_round(server),
            per_request_speculation=server.specgate_per_request_speculation,
            draft_params=tuple((param, value) for param, arg in sorted(DRAFT_PARAM_ARGS.items())
                               if (value := getattr(server, arg)) is not None),
        )


def _drafted_per_round(server: ServerInfo) -> int | None:
    """The policy's ``draft_tokens`` (tokens drafted per round) from the server's args. SGLang's
    ``speculative_num_draft_tokens`` counts the tokens one verification scores, the last accepted token
    (the draft tree's root) included, so a server launched with 8 drafts 7 per round (the deploy kit's
    policies say so). specgate's embedded worker takes the per-round count itself."""
    n = server.speculative_num_draft_tokens
    if not server.speculative_algorithm or n is None:
        return None
    return n if server.specgate_per_request_speculation else n - 1


def _algorithm(value: str | None) -> str | None:
    """Normalise: None, "" and "none" mean no speculation; NEXTN is SGLang's alias of EAGLE."""
    if value is None or value.strip().lower() in ("", "none"):
        return None
    upper = value.strip().upper()
    return "EAGLE" if upper == "NEXTN" else upper


def pair_mismatches(expected: ExpectedPair, actual: PairIdentity) -> list[str]:
    """Human-readable differences on the declared fields; empty when the worker matches."""
    problems: list[str] = []
    checks: list[tuple[str, object, object]] = [
        ("target_model_path", expected.target_model_path, actual.target_model_path),
        ("target_revision", expected.target_revision, actual.target_revision),
        ("target_weight_version", expected.target_weight_version, actual.target_weight_version),
        ("draft_model_path", expected.draft_model_path, actual.draft_model_path),
        ("draft_revision", expected.draft_revision, actual.draft_revision),
    ]
    if not actual.per_request_speculation:
        if expected.algorithm is not None:
            checks.append(("algorithm", _algorithm(expected.algorithm), actual.algorithm))
        checks.append(("draft_tokens", expected.draft_tokens, actual.draft_tokens))
    reported = dict(actual.draft_params)
    checks += [(f"draft param {param}", want, reported.get(param)) for param, want in expected.draft_params]
    for name, want, got in checks:
        if name != "algorithm" and want is None:
            continue
        if want != got:
            problems.append(f"{name}: declared {want!r}, worker reports {got!r}")
    return problems
