"""Repository conventions that, when broken, fail in confusing ways elsewhere."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).parent


def test_test_module_basenames_are_unique():
    # test folders are not packages, so pytest imports test modules by basename: a duplicate name
    # aborts collection of the whole suite ("import file mismatch")
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []


def test_workload_data_is_never_copied_into_the_repository():
    repo = TESTS.parent
    tracked = [p for p in repo.rglob("*.jsonl") if ".venv" not in p.parts and ".bench-venv" not in p.parts]
    assert tracked == []
