"""Where a command's cost model comes from: a file (``specgate trace calibrate --out``, or one filled from SGLang's
benchmarks), or a running specgate worker's live step costs (its ``/server_info``, converted by
``policies.live_costs.from_server_info``), named by its URL."""

from __future__ import annotations

import asyncio

from backends.sglang.client import SGLangClient
from backends.sglang.errors import WorkerError
from policies.costmodel import CostModelError, load_cost_model
from policies.live_costs import from_server_info


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def live_cost_model(url: str, *, revision: str | None = None, created: str = ""):
    """The CostModel of the worker at ``url``'s live step costs; a worker that cannot be read, or whose report
    cannot price replay, is a CostModelError naming the URL and the fix."""
    async def fetch():
        async with SGLangClient(url) as client:
            return await client.server_info()

    try:
        info = asyncio.run(fetch())
    except WorkerError as exc:
        raise CostModelError(f"{exc}; start the worker, or give a cost model file (specgate trace calibrate "
                             "--out FILE)") from None
    return from_server_info(info, url, revision=revision, created=created)


def load_costs(source: str, *, revision: str | None = None):
    """A cost model from a file path or a worker URL (``http://HOST:PORT``), checked against ``revision``."""
    return live_cost_model(source, revision=revision) if is_url(source) else load_cost_model(source, revision=revision)
