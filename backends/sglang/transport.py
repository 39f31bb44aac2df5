"""An httpx transport that spreads requests over several small connection pools.

httpcore's pool scans every connection and queued request on each assignment (quadratic in
concurrency); at 32 concurrent requests to one worker that scan dominated the gateway's CPU time.
``ShardedTransport`` round-robins requests over ``shards`` independent ``AsyncHTTPTransport``s, so
each pool stays small. Keep-alive connections are reused within a shard.
"""

from __future__ import annotations

import itertools

import httpx

from backends.sglang.client import KEEPALIVE_EXPIRY_S


class ShardedTransport(httpx.AsyncBaseTransport):
    def __init__(self, shards: int = 8, keepalive_per_shard: int = 16) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=keepalive_per_shard,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        self._shards = [httpx.AsyncHTTPTransport(limits=limits) for _ in range(shards)]
        self._next = itertools.cycle(self._shards)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await next(self._next).handle_async_request(request)

    async def aclose(self) -> None:
        for shard in self._shards:
            await shard.aclose()
