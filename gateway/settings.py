"""Gateway settings: one strict value built by the CLI (or a test) and handed to ``create_app``.

Secrets are not fields: the admin token is read from the environment variable named by
``admin_token_env`` when the app starts, so it never appears in a repr, a log line or argv.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta


class GatewaySettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Everything ``create_app`` needs. Times are seconds."""

    policy_path: str
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    allow_unauthenticated_public: bool = False
    admin_token_env: str = "SPECGATE_ADMIN_TOKEN"
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 4 * 1024 * 1024
    log_json: bool = True
    log_level: str = "info"
    debug_log_text: bool = False
    reload_interval_s: Annotated[float, Meta(gt=0)] = 0.5
    monitor_interval_s: Annotated[float, Meta(gt=0)] = 2.0
    snapshot_max_age_s: Annotated[float, Meta(gt=0)] = 0.1
    abort_timeout_s: Annotated[float, Meta(gt=0)] = 1.0
    max_attempts: Annotated[int, Meta(ge=1, le=8)] = 3
    upstream_read_timeout_s: Annotated[float, Meta(gt=0)] = 300.0
    trace_path: str | None = None  # `specgate serve --trace FILE`, absolute (gateway/tracing.py)
    state_url: str | None = None  # `specgate serve --state URL`: fleet state in Valkey (gateway/fleet.py)

    def __post_init__(self) -> None:
        if not Path(self.policy_path).name:
            raise ValueError("policy_path must name a file")
