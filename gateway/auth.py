"""API keys -> routes. Keys come from the environment variable or file each route names; they are
held only as SHA-256 digests, compared in constant time, and never logged.

Rules (docs/policy.md): with no route that has keys, auth is off and every request belongs to the
default route whatever bearer token it sends (as vLLM and SGLang behave without ``--api-key``). With
keys, a recognised key selects its route; a missing or unknown key falls to the route without keys
if the policy has one, else it is a 401.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from gateway.errors import ApiError
from policies.schema import Policy


def _keys_of(text: str) -> list[str]:
    """One key per line or comma; blank entries and ``#`` comment lines ignored."""
    keys = []
    for line in text.splitlines():
        if line.strip().startswith("#"):
            continue
        keys.extend(part.strip() for part in line.split(","))
    return [k for k in keys if k]


class KeyRing:
    """Built per policy version (a reload re-reads env vars and key files)."""

    def __init__(self, policy: Policy, *, base_dir: Path | None = None,
                 environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.enabled = policy.auth_enabled
        self.default_route = policy.default_route
        self._digests: list[tuple[bytes, str]] = []
        self.problems: list[str] = []
        for route in policy.routes:
            keys: list[str] = []
            if route.api_keys_env:
                value = env.get(route.api_keys_env)
                if value is None:
                    self.problems.append(f"route '{route.name}': environment variable "
                                         f"{route.api_keys_env} is not set; the route has no keys")
                keys += _keys_of(value or "")
            if route.api_keys_file:
                path = Path(route.api_keys_file)
                if not path.is_absolute() and base_dir is not None:
                    path = base_dir / path
                try:
                    keys += _keys_of(path.read_text(encoding="utf-8"))
                except OSError as exc:
                    self.problems.append(f"route '{route.name}': cannot read api_keys_file {path}: "
                                         f"{exc.strerror or exc}")
            self._digests += [(hashlib.sha256(k.encode()).digest(), route.name) for k in keys]

    @property
    def key_count(self) -> int:
        return len(self._digests)

    def route_for(self, authorization: str | None) -> str:
        """The route of a request with this ``Authorization`` header, or ApiError 401."""
        if not self.enabled:
            return self.default_route or "default"
        token = None
        if authorization and authorization[:7].lower() == "bearer ":
            token = authorization[7:].strip()
        found = None
        if token:
            digest = hashlib.sha256(token.encode()).digest()
            for known, route in self._digests:  # no early exit: time does not depend on which key
                if hmac.compare_digest(known, digest) and found is None:
                    found = route
        if found is not None:
            return found
        if self.default_route is not None:
            return self.default_route
        raise ApiError(401, "missing or invalid API key; send `Authorization: Bearer <key>` with a "
                       "key configured for one of this gateway's routes", code="invalid_api_key")


def admin_allowed(token: str | None, authorization: str | None) -> bool:
    """Constant-time check of the admin bearer token; no token configured = admin API closed."""
    if not token or not authorization or authorization[:7].lower() != "bearer ":
        return False
    return hmac.compare_digest(authorization[7:].strip().encode(), token.encode())
