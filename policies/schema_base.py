"""The policy file's building blocks shared by :mod:`policies.schema` and :mod:`policies.pairs`."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from speculation import PoolProposer


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base for everything the policy file owns."""


Name = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]+$", min_length=1, max_length=64,
                           description="letters, digits, '_', '.', '-'")]
PosFloat = Annotated[float, Meta(gt=0)]
PosInt = Annotated[int, Meta(ge=1)]
Fraction = Annotated[float, Meta(ge=0, le=1)]
DraftLen = Annotated[int, Meta(ge=1, le=64)]
Proposer = PoolProposer  # speculation.POOL_PROPOSERS
ResponseFormat = Literal["none", "text", "json_object", "json_schema"]
Url = Annotated[str, Meta(pattern=r"^https?://[^\s/]+", description="http(s)://host:port")]
