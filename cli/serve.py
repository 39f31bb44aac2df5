"""`specgate serve --policy FILE`: run the gateway (OpenAI API, admin API, metrics) with uvicorn.

With no API keys in the policy, auth is off; then binding a non-loopback address is refused unless
``--allow-unauthenticated-public`` says it is intended. ``--trace FILE`` records served requests as a replay
trace (``gateway/tracing.py``): the flag names the file, the policy's ``tracing:`` section (if any) the rest.
``--state URL`` makes the gateway a fleet member (``gateway/fleet.py``, docs/deploy.md); ``--processes N`` then
serves one port from N such processes.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from pathlib import Path
from typing import Any

import msgspec

from backends.net import is_loopback
from policies.errors import PolicyError


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
                   help="seconds to wait for a worker's next byte (a whole JSON answer asked for whole, or the next "
                        "stream chunk: a whole answer that may resume is streamed from its worker) before failing the "
                        "request with 504/502")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--debug-log-text", action="store_true",
                   help="include prompt and answer text in debug logs (never in production)")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="record served requests (prompt and output token ids: user content) as a replay trace in "
                        "FILE (0600, rotated; its folder must exist); the policy's tracing: section, if any, gives "
                        "the size cap, rotation, sample and routes, this flag the file (docs/replay.md)")
    p.add_argument("--state", metavar="URL", default=None,
                   help="make this gateway a fleet member: share the learner's sums, exploration, pair gate verdicts, "
                        "outcomes and route limits through the Valkey/Redis server at URL (valkey://, redis:// or "
                        "rediss:// host:port/db; overrides the policy's state.url; password: the policy's "
                        "state.password_env or state.password_file, else $SPECGATE_STATE_PASSWORD when set; "
                        "docs/deploy.md)")
    p.add_argument("--processes", type=int, default=1, metavar="N",
                   help="serve from N gateway processes sharing the port (one core each), made one gateway by the "
                        "fleet state (needs --state or the policy's state:); each process exports its own /metrics")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import uvicorn  # about 20 ms, and the gateway below about 0.6 s: specgate --help loads neither

    from gateway.app import create_app  # see above
    from gateway.settings import GatewaySettings  # see above
    from policies.load import load_policy_file  # about 20 ms: specgate --help reads no policy
    from telemetry.logs import configure_logging  # about 50 ms: only a server configures logging

    configure_logging(json=args.log_json, level=args.log_level)
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
            trace_path=str(Path(args.trace).absolute()) if args.trace else None, state_url=args.state)
        app = create_app(settings)
    except (ValueError, PolicyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.processes > 1:
        if policy.state is None and args.state is None:
            print("error: --processes needs the fleet state (--state URL or the policy's state: section): each "
                  "process is a gateway of its own, and only a shared store makes them act as one", file=sys.stderr)
            return 2
        if settings.trace_path is not None or policy.tracing is not None:
            print("error: --processes cannot record a trace (one file, several writers); use one process",
                  file=sys.stderr)
            return 2
        del app
        # each process builds its own app from the same settings (uvicorn's workers share the listening socket)
        os.environ[SETTINGS_ENV] = msgspec.json.encode(settings).decode()
        uvicorn.run("cli.serve:app_from_environment", factory=True, workers=args.processes, host=args.host,
                    port=args.port, log_level=args.log_level, **UVICORN)
        return 0
    app.on_startup.append(_freeze_heap)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, **UVICORN)
    return 0


# uvicorn's settings, one process or several. Idle client connections are kept 75 s, longer than common clients
# keep them (httpx and the openai SDK: 5 s), so the client closes first and never sends on a connection the
# gateway is closing. proxy_headers off: the gateway never reads the client's address or scheme, and uvicorn's
# middleware that rewrites them from X-Forwarded-* would be one more layer on every request. No "server: uvicorn"
# header: one header fewer to check and send on every answer, and no server software given away.
UVICORN = dict(access_log=False, proxy_headers=False, server_header=False, timeout_graceful_shutdown=5,
               timeout_keep_alive=75)
GC_YOUNG_THRESHOLD = 20_000  # net allocations between young-generation collections (_freeze_heap)
SETTINGS_ENV = "SPECGATE_SERVE_SETTINGS"  # `--processes N`: the settings each process builds its app from


def app_from_environment() -> Any:
    """One process of `specgate serve --processes N` (uvicorn's factory): the app for the settings the parent
    checked, a fleet member like every other process of the host."""
    from gateway.app import create_app  # the gateway, about 0.6 s: not on specgate --help
    from gateway.settings import GatewaySettings  # see above
    from telemetry.logs import configure_logging  # see above

    settings = msgspec.json.decode(os.environ[SETTINGS_ENV], type=GatewaySettings)
    configure_logging(json=settings.log_json, level=settings.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # as in one process: no INFO line per worker call
    app = create_app(settings)
    app.on_startup.append(_freeze_heap)
    return app


def _freeze_heap() -> None:
    """Once started (modules imported, policy compiled, clients open), move every live object to the
    collector's permanent generation (``gc.freeze``): a full collection on the request path then walks only
    what requests made since, not the ~50k objects of start-up. Cyclic garbage frozen this way (none is
    expected: start-up's is collected first) would never be freed. The young generation is then collected every
    ``GC_YOUNG_THRESHOLD`` net allocations instead of 700: at c32 each collection walked the live objects of every
    request in flight again, and with 20,000 the gateway spends 0.89x the CPU per request (bench.gateway_compare,
    docs/runs/2026-12-06-gateway-fastpath); what it costs is up to that many objects of cyclic garbage held longer."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)
