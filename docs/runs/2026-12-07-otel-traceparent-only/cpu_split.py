"""Each gateway's user and system CPU per request, trace export off (``specgate``) and on at 100% sampling
(``specgate-otel``), under wrk at c32 in alternating 4 s rounds, read from /proc (the exporter child's apart), with
page faults. The gateways run from TREE (``bench.gateway``'s ``--gateway-tree``); scratch switches there read
``SCRATCH`` from the environment (README.md).

    SCRATCH=noship .venv/bin/python docs/runs/2026-12-07-otel-traceparent-only/cpu_split.py TREE [ROUNDS]
"""
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.gateway import gateways, wrk  # noqa: E402 - the checkout first on the path
from bench.processes import free_port, running  # noqa: E402

TREE = Path(sys.argv[1]) if len(sys.argv) > 1 else None
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 4
TICK = os.sysconf("SC_CLK_TCK")
SAMPLE = float(os.environ.get("SAMPLE", "1"))  # the otel arm's sampled share


def cpu(pid):
    """utime, stime, minflt of ``pid``."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) / TICK, int(f[12]) / TICK, int(f[7])


def children(pid):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == str(pid):
                    out.append(int(p))
            except OSError:
                pass
    return out


with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    port = free_port()
    instant = f"http://127.0.0.1:{port}"
    with running([sys.executable, "-m", "bench.instant_worker", "--port", str(port)], f"{instant}/health",
                 tmp / "w.log"), gateways(instant, "instant", tmp, ["specgate", "specgate-otel"], TREE, SAMPLE) as (
            urls, pids, _):
        body = {"model": "instant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        for name in pids:
            wrk(urls[name], body, 32, 2, tmp)  # warm-up
        total = {name: [0.0, 0.0, 0.0, 0.0, 0] for name in pids}  # user, sys, children, requests, faults
        for _ in range(ROUNDS):
            for name in ("specgate", "specgate-otel"):
                kids = children(pids[name])
                a, ka = cpu(pids[name]), [cpu(k) for k in kids]
                rps = wrk(urls[name], body, 32, 4, tmp)["rps"]
                b, kb = cpu(pids[name]), [cpu(k) for k in kids]
                t = total[name]
                t[0] += b[0] - a[0]
                t[1] += b[1] - a[1]
                t[2] += sum(y[0] + y[1] - x[0] - x[1] for x, y in zip(ka, kb))
                t[3] += rps * 4
                t[4] += b[2] - a[2]
                print(name, f"{rps:.0f} req/s", flush=True)
        for name, (user, system, kids, requests, faults) in total.items():
            print(f"{name}: user {1e6 * user / requests:.1f} us/req, sys {1e6 * system / requests:.1f} us/req, "
                  f"children {1e6 * kids / requests:.1f} us/req, minflt/req {faults / requests:.3f}, "
                  f"req/s {requests / (4 * ROUNDS):.0f}")
