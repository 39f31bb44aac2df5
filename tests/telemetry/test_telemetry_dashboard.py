"""The dashboard in a real headless chromium against a real server process (tests/telemetry/dashboard_server.py).

Chromium is Debian's package, installed here when missing (CI runs as root). The page must load with no
console errors or exceptions, refresh live, draw every chart with data, the speedup table and the pair gates
(tests/telemetry/gate_script.py's pools: state, verdict, ramp regions, last events); the route filter must
show the acceptance curve of a route that has traffic. The screenshot lands in artifacts/telemetry/.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.prerequisites import missing
from tests.telemetry.cdp import CHROMIUM, Browser

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "artifacts" / "telemetry" / "dashboard.png"
CHARTS = ("chart-accept-length", "chart-positions", "chart-tpot", "chart-goodput", "chart-explore", "chart-rules",
          "chart-pool-load", "chart-kv")


@pytest.fixture(scope="session")
def chromium() -> Path:
    if not CHROMIUM.exists():
        if os.geteuid() != 0:
            missing("chromium is not installed and installing it (apt-get install chromium) needs root")
        for command in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]):
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ,
                                  "DEBIAN_FRONTEND": "noninteractive"}, timeout=900)
            assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return CHROMIUM


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("dashboard_server.py")), "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dashboard server exited with {proc.returncode}: {proc.stderr.read()}")
            try:
                if httpx.get(base + "/dashboard/data", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "dashboard server did not answer within 60 s"
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _select_route(browser: Browser, route: str) -> None:
    browser.evaluate(f"(() => {{ const s = document.getElementById('route'); s.value = '{route}'; "
                     "s.dispatchEvent(new Event('change')); return true; })()")


def _rows(browser: Browser, selector: str) -> list[list[str]]:
    return browser.evaluate(f"Array.from(document.querySelectorAll({selector!r}))"
                            ".map(r => Array.from(r.cells).map(c => c.textContent))")


def _check_gates(browser: Browser) -> None:
    """The scripted gates: ngram degraded (a ramping and a closed region, a collapse), draft failed on a mismatch."""
    assert browser.evaluate("window.__dashboard.gates") == {"draft": {"state": "failed", "regions": 0, "events": 2},
                                                            "ngram": {"state": "degraded", "regions": 2, "events": 4}}
    badges = browser.evaluate("Array.from(document.querySelectorAll('#gates .gate')).map(g => [g.dataset.pool, "
                              "g.querySelector('h3 .badge').textContent, g.querySelector('h3 .badge').className, "
                              "getComputedStyle(g.querySelector('h3 .badge')).backgroundColor])")
    assert badges == [["draft", "failed", "badge failed", "rgb(198, 40, 40)"],
                      ["ngram", "degraded", "badge degraded", "rgb(217, 130, 43)"]]
    ngram = "#gates [data-pool=ngram] table"
    regions = _rows(browser, f"{ngram}:nth-of-type(2) tr")
    assert regions[0] == ["slice", "in flight", "share", "window (spec / plain)", "windows", "last window"]
    assert regions[1] == ["code", "3-4", "50 %", "0 / 0", "1",
                          "share -> 0.50 (TPOT 0.50x plain, TTFT 1.00x plain, SLO 1.00 vs 1.00)"]
    assert regions[2][:2] == ["prose", "1"] and re.fullmatch(r"closed \((9|10) min left\)", regions[2][2]), regions[2]
    assert _rows(browser, f"{ngram}:nth-of-type(1) tr")[1] == ["passed", "8", "256", "2.60", "0.41", "12.5", "–"]
    events = _rows(browser, f"{ngram}:nth-of-type(3) tr")
    assert [row[1:3] for row in events[1:]] == [["collapse", "passed → degraded"], ["serving", "passed → passed"],
                                                 ["equivalence", "pending → passed"], ["version", "pending"]]
    assert events[1][3] == "slice prose: accept length 1.00 per round < floor 1.05 (baseline 2.60)"
    assert _rows(browser, "#gates [data-pool=draft] table:nth-of-type(1) tr")[1] == [
        "failed", "3", "70", "2.10", "–", "4.0", "canary code-1, output position 3: speculative token 42, plain token 17"]
    assert browser.evaluate("document.querySelector('#gates [data-pool=ngram] > p').textContent") == \
        "slice prose: accept length 1.00 per round < floor 1.05 (baseline 2.60)"


def test_page_and_assets_are_served_from_the_package(server: str) -> None:
    page = httpx.get(server + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text, "the page must not load anything remote"
    for asset in ("chart.umd.min.js", "dashboard.js", "dashboard.css"):
        response = httpx.get(f"{server}/dashboard/static/{asset}")
        assert response.status_code == 200, asset
        assert response.content == (ROOT / "telemetry" / "static" / asset).read_bytes()
    assert httpx.get(server + "/dashboard/static/../core.py").status_code == 404


def test_dashboard_renders_every_chart_without_errors(chromium: Path, server: str, tmp_path: Path) -> None:
    browser = Browser(tmp_path / "profile")
    try:
        browser.navigate(server + "/dashboard")
        # two completed polls: the first render and a live refresh that updated the charts in place
        browser.wait_for("window.__dashboard && window.__dashboard.updates >= 2", timeout_s=30)
        assert browser.evaluate("window.__dashboard.error") is None
        points = browser.evaluate("window.__dashboard.points")
        assert set(points) == set(CHARTS)
        assert {chart: n for chart, n in points.items() if n == 0} == {}
        assert browser.evaluate(f"{list(CHARTS)}.every(id => Chart.getChart(id) !== undefined)")
        assert browser.evaluate("document.querySelectorAll('#pools tr').length") == 1 + 3 + 4  # header, pools, workers
        tiles = browser.evaluate("['rps','goodput','attainment','accept'].map(t => "
                                 "document.getElementById('tile-' + t).textContent)")
        assert "–" not in tiles, tiles
        # realised speedup table: slice rows x load columns; prose is served both ways, code and tool calls only
        # speculatively: code against its worker's plain estimates (≈, 1.5x by construction), tool calls without
        # any ("–"); the traffic cycles through 1, 2, 3, 6 and 12 requests in flight
        speedup = browser.evaluate("Array.from(document.querySelectorAll('#speedup tr'))"
                                   ".map(r => Array.from(r.cells).map(c => c.textContent))")
        assert speedup[0] == ["slice \\ in flight", "1", "2", "3-4", "5-8", "9-16"]
        rows = {row[0]: row[1:] for row in speedup[1:]}
        assert sorted(rows) == ["code", "prose", "tool_call"]
        assert rows["tool_call"] == ["–"] * 5
        assert all(re.fullmatch(r"≈1\.50x \(n=\d+/0\)", text) for text in rows["code"]), rows["code"]
        assert all(re.fullmatch(r"\d+\.\d\dx \(n=\d+/\d+\)", text) for text in rows["prose"]), rows["prose"]
        assert browser.evaluate("window.__dashboard.speedup") == {"rows": 3, "loads": 5, "ratios": 5, "estimated": 5}

        _check_gates(browser)
        evidence = browser.evaluate("Array.from(document.querySelectorAll('#evidence tr'))"
                                    ".map(r => Array.from(r.cells).map(c => c.textContent))")
        assert evidence == [["route", "slice", "options taught"], ["default", "prose", "24"]]

        # filter to route "ide": its acceptance curves are per slice and pool, acceptance falls with position
        _select_route(browser, "ide")
        curves = browser.evaluate("Object.fromEntries(Chart.getChart('chart-positions').data.datasets"
                                  ".map(d => [d.label, d.data]))")
        assert set(curves) == {"code · ngram", "prose · draft", "tool_call · draft"}
        code = curves["code · ngram"]
        assert len(code) == 4 and all(0 < v <= 100 for v in code) and code[0] > code[-1]
        labels = browser.evaluate("Chart.getChart('chart-accept-length').data.datasets.map(d => d.label)")
        assert sorted(labels) == ["code", "prose", "tool_call"]
        tpot = browser.evaluate("Chart.getChart('chart-tpot').data.datasets.map(d => [d.label, "
                                "d.data.filter(v => v !== null).length])")
        assert [label for label, n in tpot if n > 0] == ["speculative", "plain"]
        explore = browser.evaluate("Object.fromEntries(Chart.getChart('chart-explore').data.datasets"
                                   ".map(d => [d.label, d.data.filter(v => v !== null)]))")
        assert sorted(explore) == ["code", "prose", "tool_call"]
        assert all(0 <= v <= 100 for shares in explore.values() for v in shares)
        # code is pinned by its rule (never explores); a fifth of the learned draft requests explored
        assert set(explore["code"]) == {0} and max(explore["tool_call"]) > 0
        rules = browser.evaluate("Chart.getChart('chart-rules').data.datasets.map(d => d.label)")
        assert rules == ["code-ngram", "kv-pressure", "learned"]
        # the table follows the route filter too
        assert browser.evaluate("document.querySelectorAll('#speedup tr').length") == 1 + 3
        assert browser.evaluate("window.__dashboard.speedup.ratios") == 5

        _select_route(browser, "")
        browser.screenshot(SCREENSHOT)
        assert browser.errors == []
    finally:
        browser.close()
    assert SCREENSHOT.stat().st_size > 20_000
