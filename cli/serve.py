"""`specgate serve --policy FILE`: run the gateway (OpenAI API, admin API, metrics) with uvicorn.

With no API keys in the policy, auth is off; then binding a non-loopback address is refused unless
``--allow-unauthenticated-public`` says it is intended. ``--trace FILE`` records served requests as a replay
trace (``gateway/tracing.py``): the flag names the file, the policy's ``tracing:`` section (if any) the rest.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="run the gateway in front of the policy's worker pools",
        description="Serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models), "
                    "/admin/*, /metrics, /dashboard, /health and /ready, deciding per request by the "
                    "policy file, which is reloaded when it changes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--policy", required=True, help="policy YAML file (see docs/policy.md)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--allow-unauthenticated-public", action="store_true",
                   help="allow a non-loopback --host although the policy configures no API keys")
    p.add_argument("--admin-token-env", default="SPECGATE_ADMIN_TOKEN",
                   help="environment variable holding the admin API bearer token (unset: admin API off)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body accepted; larger ones get a 413 before parsing")
    log = p.add_mutually_exclusive_group()
    log.add_argument("--log-json", dest="log_json", action="store_true", default=True,
                     help="JSON log lines (default)")
    log.add_argument("--log-console", dest="log_json", action="store_false", help="human-readable logs")
    p.add_argument("--upstream-read-timeout-s", type=float, default=300.0,
                   help="seconds to wait for a worker's next byte (a whole JSON answer, or the next stream chunk) "
                        "before failing the request with 504/502")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--debug-log-text", action="store_true",
                   help="include prompt and answer text in debug logs (never in production)")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="record served requests (prompt and output token ids: user content) as a replay trace in "
                        "FILE (0600, rotated; its folder must exist); the policy's tracing: section, if any, gives "
                        "the size cap, rotation, sample and routes, this flag the file (docs/replay.md)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app
    from backends.net import is_loopback
    from gateway.settings import GatewaySettings
    from policies.errors import PolicyError
    from policies.load import load_policy_file
    from telemetry.logs import configure_logging

    configure_logging(json=args.log_json, level=args.log_level)
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per worker call otherwise
    try:
        policy = load_policy_file(args.policy)
    except PolicyError as exc:
        print(f"error: invalid policy {args.policy}:\n" + "\n".join(exc.errors), file=sys.stderr)
        return 2
    if not policy.auth_enabled and not is_loopback(args.host) and not args.allow_unauthenticated_public:
        print(f"error: refusing to listen on {args.host}: the policy configures no API keys, so anyone "
              "who can reach it could use it. Add routes with api_keys_env/api_keys_file, listen on "
              "127.0.0.1, or pass --allow-unauthenticated-public.", file=sys.stderr)
        return 2
    try:
        settings = GatewaySettings(
            policy_path=args.policy, host=args.host, port=args.port,
            allow_unauthenticated_public=args.allow_unauthenticated_public,
            admin_token_env=args.admin_token_env, max_body_bytes=args.max_body_bytes,
            log_json=args.log_json, log_level=args.log_level, debug_log_text=args.debug_log_text,
            upstream_read_timeout_s=args.upstream_read_timeout_s,
            trace_path=str(Path(args.trace).absolute()) if args.trace else None)
        app = create_app(settings)
    except (ValueError, PolicyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    app.on_startup.append(_freeze_heap)
    # idle client connections are kept 75 s, longer than common clients keep them (httpx and the openai
    # SDK: 5 s), so the client closes first and never sends on a connection the gateway is closing
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_graceful_shutdown=5, timeout_keep_alive=75)
    return 0


def _freeze_heap() -> None:
    """Once started (modules imported, policy compiled, clients open), move every live object to the
    collector's permanent generation (``gc.freeze``): a full collection on the request path then walks only
    what requests made since, not the ~50k objects of start-up. Cyclic garbage frozen this way (none is
    expected: start-up's is collected first) would never be freed."""
    gc.collect()
    gc.freeze()
