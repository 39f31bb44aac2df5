"""The built-in dashboard: ``GET /dashboard`` (page), ``/dashboard/data`` (JSON), ``/dashboard/static/*``.

Everything the page needs ships in the package (``telemetry/static``: the page, its script, and a
vendored Chart.js 4.6.1 UMD build with its MIT license), so it works on an air-gapped cluster. The page
polls ``/dashboard/data`` every few seconds and derives every ratio from the summed counts it gets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Response, Router, get
from litestar.static_files import create_static_files_router

from telemetry.core import Telemetry

STATIC = Path(__file__).parent / "static"


def router(telemetry: Telemetry) -> Router:
    """Mount with ``Litestar(route_handlers=[..., router(telemetry)])``."""
    page = (STATIC / "dashboard.html").read_bytes()

    @get("/", include_in_schema=False, sync_to_thread=False)
    def dashboard_page() -> Response[bytes]:
        return Response(page, media_type="text/html", headers={"Cache-Control": "no-cache"})

    @get("/data", include_in_schema=False, sync_to_thread=False)
    def dashboard_data() -> Response[dict[str, Any]]:
        return Response(telemetry.dashboard_data(), headers={"Cache-Control": "no-store"})

    static = create_static_files_router(path="/static", directories=[STATIC], include_in_schema=False)
    return Router(path="/dashboard", route_handlers=[dashboard_page, dashboard_data, static])
