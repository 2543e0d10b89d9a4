"""The house rules that a scan can check: no module of the package over MODULE_LINES lines, the
proxy's functions small, and no test module imports another test module (shared fixtures live in conftest.py files, shared
helpers in the support modules at tests/ top level)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "molctl"
PROXY = PACKAGE / "proxy"
MODULE_LINES = 600
FUNCTION_LINES = 60


def long_functions(path: Path, limit: int) -> list[str]:
    """`name:length` of each function in `path` longer than `limit` lines."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{node.name}:{node.end_lineno - node.lineno + 1}"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_module_over_the_size_limit():
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in sorted(PACKAGE.rglob("*.py"))}
    over = {str(p): n for p, n in sizes.items() if n > MODULE_LINES}
    assert not over, f"modules over {MODULE_LINES} lines (split them by concern): {over}"


def test_no_proxy_function_over_the_size_limit():
    over = {
        str(p.relative_to(ROOT)): f for p in sorted(PROXY.rglob("*.py")) if (f := long_functions(p, FUNCTION_LINES))
    }
    assert not over, f"proxy functions over {FUNCTION_LINES} lines: {over}"


def test_the_function_scan_measures_a_long_function(tmp_path):
    probe = tmp_path / "m.py"
    probe.write_text("def short():\n    pass\n\n\nasync def long():\n" + "    x = 1\n" * 5)
    assert long_functions(probe, 3) == ["long:6"]


def imported_test_modules(path: Path) -> list[str]:
    """The test modules (`test_*` or `conftest`) that `path` imports."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return [n for n in names if n.split(".")[-1].startswith("test_") or n.split(".")[-1] == "conftest"]


def test_no_test_module_imports_another_test_module():
    found = {
        str(p.relative_to(ROOT)): names
        for p in sorted((ROOT / "tests").rglob("test_*.py"))
        if (names := imported_test_modules(p))
    }
    assert not found, f"test modules importing test modules (move the helper to a conftest or support module): {found}"


def test_the_import_scan_finds_a_test_module_import(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text("from tests.test_other import helper\nfrom tests.helpers import run\nimport tests.conftest\n")
    assert imported_test_modules(probe) == ["tests.test_other", "tests.conftest"]
