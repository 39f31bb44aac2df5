"""bench.profile_gateway's tables from py-spy's raw (collapsed) stacks: own-line, inclusive and per-file shares."""

from __future__ import annotations

from bench.profile_gateway import report, shares

SP = "/x/.venv/lib/python3.11/site-packages"
RAW = [
    # 6 samples in send (uvicorn), under run_asgi -> app
    f"run_asgi ({SP}/uvicorn/h.py:10);__call__ (/r/gateway/app.py:5);send ({SP}/uvicorn/h.py:500) 6",
    # 3 samples in serve's own lines at two line numbers: one function
    "run_asgi (/r/x.py:1);serve (/r/gateway/lifecycle.py:150) 2",
    "run_asgi (/r/x.py:1);serve (/r/gateway/lifecycle.py:160) 1",
    # recursion: a function twice on one stack counts once in its inclusive share
    "f (/r/a.py:1);f (/r/a.py:2);g (/r/a.py:3) 1",
    "",
]


def test_shares_are_of_all_samples_and_merge_a_function_s_lines():
    table = shares(RAW, top=10)
    own = dict(table["self"])
    assert own == {f"send ({SP}/uvicorn/h.py)": 0.6,
                   "serve (/r/gateway/lifecycle.py)": 0.3, "g (/r/a.py)": 0.1}
    inclusive = dict(table["inclusive"])
    assert inclusive["__call__ (/r/gateway/app.py)"] == 0.6
    assert inclusive[f"run_asgi ({SP}/uvicorn/h.py)"] == 0.6  # not 0.9: x.py's run_asgi is another function
    assert inclusive["f (/r/a.py)"] == 0.1  # on its stack twice, counted once
    assert dict(table["file"]) == {"uvicorn/h.py": 0.6, "/r/gateway/lifecycle.py": 0.3, "/r/a.py": 0.1}


def test_top_cuts_each_table_and_the_report_prints_percentages():
    table = shares(RAW, top=1)
    assert [len(rows) for rows in table.values()] == [1, 1, 1]
    text = report(table)
    assert " 60.0%  uvicorn/h.py" in text and "with what it calls" in text


def test_no_samples_give_empty_tables():
    assert shares(["", "garbage"], top=5) == {"self": [], "inclusive": [], "file": []}
