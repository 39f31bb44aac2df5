"""policies/ is pure: every module imports only the stdlib, msgspec, yaml, the speculation vocabulary and policies
itself (never torch, litestar or httpx)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ALLOWED = {"msgspec", "yaml", "policies", "speculation"}
PACKAGE = Path(__file__).resolve().parents[2] / "policies"


def test_policies_imports_only_stdlib_msgspec_yaml() -> None:
    modules = sorted(PACKAGE.glob("*.py"))
    assert len(modules) >= 10
    bad = []
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in ALLOWED and top not in sys.stdlib_module_names:
                    bad.append(f"{path.name}: {name}")
    assert bad == []
