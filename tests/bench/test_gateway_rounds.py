"""bench.gateway's report over several rounds: medians per arm, and each specgate arm against smg round by round
(the pairing that survives a machine whose speed drifts between rounds)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench.gateway import _policy, environment
from bench.gateway_report import against, medians, table


def _row(via: str, c: int, rnd: int, rps: float, p50: float, cpu: float = 100.0) -> dict:
    return {"worker": "instant", "via": via, "concurrency": c, "round": rnd, "rps": rps, "p50_ms": p50,
            "p99_ms": 2 * p50, "cpu_us_per_req": cpu, "child_cpu_us_per_req": cpu / 4, "non_2xx": rnd}


ROWS = [
    # round 0: a fast machine; round 1: everything 2x slower; round 2: in between
    _row("direct", 1, 0, 30000, 0.03), _row("specgate-2p", 1, 0, 3000, 0.30), _row("smg", 1, 0, 6000, 0.12),
    _row("direct", 32, 0, 90000, 0.3), _row("specgate-2p", 32, 0, 6000, 5.0), _row("smg", 32, 0, 12000, 2.5),
    _row("direct", 1, 1, 15000, 0.06), _row("specgate-2p", 1, 1, 1500, 0.60), _row("smg", 1, 1, 3000, 0.24),
    _row("direct", 32, 1, 45000, 0.6), _row("specgate-2p", 32, 1, 3300, 10.0), _row("smg", 32, 1, 6000, 5.0),
    _row("direct", 1, 2, 20000, 0.05), _row("specgate-2p", 1, 2, 2000, 0.40), _row("smg", 1, 2, 4000, 0.20),
    _row("direct", 32, 2, 60000, 0.45), _row("specgate-2p", 32, 2, 4200, 7.5), _row("smg", 32, 2, 8000, 3.75),
]


def test_medians_are_per_arm_and_concurrency_over_the_rounds():
    got = {(r["via"], r["concurrency"]): r for r in medians(ROWS)}
    assert got["smg", 32]["rps"] == 8000 and got["specgate-2p", 1]["p50_ms"] == 0.40
    assert got["specgate-2p", 32]["rounds"] == 3 and got["specgate-2p", 32]["non_2xx"] == 0 + 1 + 2


def test_against_pairs_rounds_so_drift_cancels():
    # per round: req/s ratios 0.50, 0.55, 0.525; p50 gaps +0.18, +0.36, +0.20 ms
    line = against(ROWS, "specgate-2p", "smg", 32, 1)
    assert line == ("\nspecgate-2p / smg over 3 rounds, median [min, max]: req/s at c=32 0.525 [0.500, 0.550]x; "
                    "p50 at c=1 +0.200 [+0.180, +0.360] ms over smg's")
    assert against(ROWS, "specgate", "smg", 32, 1) == ""  # an arm not measured


def test_the_table_reports_medians_and_the_paired_lines():
    text = table(ROWS, {"command": "x"})
    assert "| instant | specgate-2p | 32 | 4200.0 | 7.50 | 15.00 | +7.05 | 100 | 25 | 3 |" in text
    assert "specgate-2p / smg over 3 rounds" in text


def test_tracing_on_is_paired_with_off_round_by_round():
    rows = [{**r, "via": {"smg": "specgate", "specgate-2p": "specgate-otel"}.get(r["via"], r["via"])} for r in ROWS]
    text = table(rows, {"command": "x"})
    assert ("\nspecgate-otel / specgate over 3 rounds, median [min, max]: req/s at c=32 0.525 [0.500, 0.550]x; "
            "p50 at c=1 +0.200 [+0.180, +0.360] ms over specgate's") in text


def test_an_older_tree_runs_with_its_own_shipped_policy(tmp_path: Path):
    """--gateway-tree: the older gateway reads that checkout's default policy (today's may name pool kinds it does
    not know), pointed at the benchmark's worker and without its gates."""
    tree = tmp_path / "old"
    (tree / "deploy/policies").mkdir(parents=True)
    (tree / "deploy/policies/default.yaml").write_text(
        "version: 1\npools:\n  plain: {workers: [\"http://127.0.0.1:30000\"]}\ngates:\n  canaries: 4\n")
    text = _policy("http://127.0.0.1:9", tmp_path, tree=tree).read_text()
    assert text == "version: 1\npools:\n  plain: {workers: [\"http://127.0.0.1:9\"]}\n"
    assert "hybrid" in _policy("http://127.0.0.1:9", tmp_path).read_text()  # no tree: today's default


def test_the_report_names_the_commit_of_the_gateway_measured(tmp_path: Path):
    """With --gateway-tree the measured gateway is that checkout's, and the report's `specgate` line says so."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *argv], check=True, capture_output=True,
                              text=True).stdout.strip()
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "older")
    older = git("rev-parse", "--short", "HEAD")
    assert environment(tmp_path)["specgate"] == f"0.1.0 ({older})"
    assert older not in environment()["specgate"]


def test_the_report_says_whether_every_sampled_requests_spans_arrived():
    rows = [{**r, "via": "specgate-otel" if r["via"] == "smg" else r["via"]} for r in ROWS]
    rows[2].update(spans_exported=4990, requests_counted=1000, traces_dropped=2)
    assert ("spans the sink received from specgate-otel: 4990 for 1000 requests it served, warm-up included (4.99 "
            "per request; a sampled request has 5); requests whose spans the gateway dropped: 2") in table(rows, {})
