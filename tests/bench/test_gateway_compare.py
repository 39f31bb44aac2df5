"""bench.gateway_compare's analysis: paired after/before ratios with a bootstrap interval over rounds, and the
policy both gateways run (the instant worker's URL, no gates)."""

from __future__ import annotations

import math
import threading

import bench.gateway_compare as compare
from bench.gateway_compare import policy_text, ratio_summary, report


def _row(round_: int, c: int, before: tuple[float, float, float], after: tuple[float, float, float]) -> dict:
    keys = ("rps", "p50_ms", "cpu_us_per_req")
    return {"round": round_, "first": "before", "concurrency": c,
            "before": dict(zip(keys, before)), "after": dict(zip(keys, after))}


def test_ratio_summary_is_the_median_of_paired_ratios_with_an_interval_around_it():
    s = ratio_summary([100, 200, 100, 400, 100], [110, 220, 100, 440, 90])
    assert s["median"] == 1.1
    assert s["low"] <= s["median"] <= s["high"] and 0.9 <= s["low"] and s["high"] <= 1.1
    one = ratio_summary([100], [120])
    assert one["median"] == 1.2 and math.isnan(one["low"]) and math.isnan(one["high"])
    assert ratio_summary([1, 1, 1], [2, 2, 2]) == {"median": 2.0, "low": 2.0, "high": 2.0}


def test_report_lists_each_round_and_the_ratio_per_concurrency_and_metric():
    rows = [_row(1, 1, (1000, 0.40, 300), (1100, 0.40, 270)), _row(2, 1, (1000, 0.50, 300), (1000, 0.45, 300))]
    text = report(rows, [1])
    assert "| 1 | before | 1 | 1000.0 | 1100.0 | 0.40 | 0.40 | 300 | 270 |" in text
    assert "| 1 | req/s | 1000.00 | 1050.00 | 1.050 |" in text
    assert "| 1 | CPU us/req | 300.00 | 285.00 | 0.950 |" in text


def test_the_policy_points_at_the_instant_worker_and_has_no_gates(tmp_path):
    source = tmp_path / "p.yaml"
    source.write_text("pools:\n  plain: {workers: ['http://127.0.0.1:30000']}\ngates:\n  equivalence: {}\n")
    assert policy_text(source, "http://127.0.0.1:4242") == "pools:\n  plain: {workers: ['http://127.0.0.1:4242']}\n"


def test_together_measures_both_gateways_in_one_window_each_with_its_own_wrk_script(tmp_path, monkeypatch):
    both = threading.Barrier(2, timeout=30)  # broken (an error) unless the two measurements overlap
    seen = {}

    def measure(url, pid, body, concurrency, duration, tmp):
        both.wait()
        seen[url] = tmp
        return {"rps": float(pid), "p50_ms": 1.0, "cpu_us_per_req": 2.0}

    monkeypatch.setattr(compare, "measure", measure)
    rows = compare.measure_together({"before": ("u-before", 10), "after": ("u-after", 20)}, {}, 32, 1.0, tmp_path)
    assert rows == {"before": {"rps": 10.0, "p50_ms": 1.0, "cpu_us_per_req": 2.0},
                    "after": {"rps": 20.0, "p50_ms": 1.0, "cpu_us_per_req": 2.0}}
    assert seen == {"u-before": tmp_path / "before", "u-after": tmp_path / "after"}
    assert (tmp_path / "before").is_dir() and (tmp_path / "after").is_dir()
