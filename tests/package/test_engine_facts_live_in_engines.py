"""Engine facts (flag names, metric names, refusal texts, fallbacks) are hooks of
`molctl/engines/<kind>.py`: the name of an engine kind appears as a string literal nowhere else
in the package but the profile schema's list of kinds."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "molctl"
KINDS = {"vllm", "sglang"}
ALLOWED = {("profilespec.py", "ENGINE_KINDS")}  # the schema's list of kinds


def literal_kinds(path: Path) -> list[int]:
    """The lines of each string constant that is exactly an engine kind, outside ALLOWED."""
    tree = ast.parse(path.read_text(), str(path))
    allowed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and (path.name, t.id) in ALLOWED for t in node.targets
        ):
            allowed.update(id(n) for n in ast.walk(node.value))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in KINDS and id(node) not in allowed
    ]


def test_no_engine_kind_literal_outside_the_engines_package():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "engines"
        for line in literal_kinds(path)
    ]
    assert not found, f"engine kinds as literals outside molctl/engines/ (make them Engine hooks): {found}"


def test_the_scan_finds_a_kind_literal_and_spares_the_kinds_list(tmp_path):
    probe = tmp_path / "profilespec.py"
    probe.write_text('ENGINE_KINDS = ("vllm", "sglang")\nif kind == "sglang":\n    pass\n')
    assert literal_kinds(probe) == [2]
