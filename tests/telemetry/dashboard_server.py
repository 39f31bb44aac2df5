"""A real dashboard server for the browser test: Telemetry fed with 10 minutes of synthetic traffic and the
scripted pair gates (tests/telemetry/gate_script.py, run over the last minute), then a live trickle, served
by uvicorn on ``--port`` (the test picks a free loopback port).

Run: python tests/telemetry/dashboard_server.py --port 8123
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import uvicorn
from litestar import Litestar, Response, get

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, when run as a script

from gateway.gates.book import GateBook  # noqa: E402
from gateway.telemetry_views import gate_event_view, gate_views, policy_view  # noqa: E402
from policies.load import load_policy_file  # noqa: E402
from policies.schema import Policy  # noqa: E402
from telemetry import Telemetry  # noqa: E402
from telemetry.dashboard import router  # noqa: E402
from telemetry.logs import configure_logging  # noqa: E402
from tests.telemetry.gate_script import script  # noqa: E402
from tests.telemetry.traffic import pool_state, traffic  # noqa: E402

POLICY = Path(__file__).with_name("policy.yaml")


def build(policy: Policy, seed: int = 7, history_s: float = 600.0) -> tuple[Telemetry, GateBook]:
    telemetry = Telemetry(policy_view(policy))
    rng = random.Random(seed)
    now = time.time()
    for record in traffic(policy, rng, now - history_s, now):
        telemetry.observe(record)
    # full-information evidence of the learned prose requests: three options each, eight answers
    for _ in range(8):
        telemetry.observe_evidence("default", "prose", 3, 0.002)
    t = now - history_s
    while t <= now:
        telemetry.set_pools(pool_state(policy, rng), now=t)
        t += 5.0
    book, events = script(time.monotonic() - 40.0, now - 40.0)
    telemetry.record_gate_events([gate_event_view(e) for e in events])
    telemetry.set_gates(gate_views(book, time.monotonic()))
    return telemetry, book


def app(policy: Policy, telemetry: Telemetry, book: GateBook) -> Litestar:
    @get("/metrics", sync_to_thread=False)
    def metrics() -> Response[bytes]:
        body, content_type = telemetry.metrics_response()
        return Response(body, media_type=content_type)

    async def trickle() -> None:
        rng = random.Random(11)
        while True:
            await asyncio.sleep(1.0)
            now = time.time()
            for record in traffic(policy, rng, now - 1.0, now):
                telemetry.observe(record)
            telemetry.set_pools(pool_state(policy, rng))
            telemetry.record_gate_events([gate_event_view(e) for e in book.drain()])
            telemetry.set_gates(gate_views(book, time.monotonic()))

    tasks: list[asyncio.Task[None]] = []
    return Litestar(route_handlers=[router(telemetry), metrics],
                    on_startup=[lambda: tasks.append(asyncio.get_running_loop().create_task(trickle()))],
                    on_shutdown=[lambda: [task.cancel() for task in tasks]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    configure_logging(json=True, level="critical")
    policy = load_policy_file(POLICY)
    uvicorn.run(app(policy, *build(policy)), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
