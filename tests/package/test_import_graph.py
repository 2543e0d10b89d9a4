"""The package's import graph, read from the source (imports inside functions and under
TYPE_CHECKING count: they close a circle as well as a top-level one): no import circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_names(root: Path) -> dict[str, Path]:
    names = {}
    for path in (root / "molctl").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source (`from a import b` counts
    as a.b where b is a module, else as a)."""
    names = module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                while target and target not in names:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)
    return found


def test_no_import_circle():
    found = [sorted(c) for c in circles(import_graph(ROOT))]
    assert not found, f"import circles (cut the arrow that runs back up): {found}"


def test_the_scan_finds_a_circle_closed_inside_a_function_or_under_type_checking(tmp_path):
    pkg = tmp_path / "molctl"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from molctl.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .c import x\n")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from molctl import a\n")
    (pkg / "d.py").write_text("import molctl.a\n")
    assert circles(import_graph(tmp_path)) == [{"molctl.a", "molctl.sub.b", "molctl.sub.c"}]


# The package's layers, lowest first: a module may import its own layer and the ones below it,
# never one above (counting imports inside functions and under TYPE_CHECKING). A module takes
# the layer of the longest name below that matches it; every module must match one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "molctl",
            "molctl.errors",
            "molctl.routes",
            "molctl.hashing",
            "molctl.redaction",
            "molctl.procid",
            "molctl.flocks",
            "molctl.cudacompat",
            "molctl.safetensors",
            "molctl.keys",
            "molctl.localhttp",
            "molctl.probes",
            "molctl.logfiles",
            "molctl.phases",
            "molctl.prefetch",
        ),
    ),
    ("host state", ("molctl.state", "molctl.processes")),
    (
        "profile",
        ("molctl.profileyaml", "molctl.profilespec", "molctl.profilechecks", "molctl.profiles", "molctl.stackconfig"),
    ),
    ("engines", ("molctl.engines",)),
    ("proxy", ("molctl.proxy",)),
    (
        "operations",
        (
            "molctl.bench",
            "molctl.checks",
            "molctl.claims",
            "molctl.demo",
            "molctl.enginecache",
            "molctl.lifecycle",
            "molctl.logs",
            "molctl.manifest",
            "molctl.manifestfile",
            "molctl.output",
            "molctl.render",
            "molctl.storeadmin",
            "molctl.top",
        ),
    ),
    ("cli", ("molctl.__main__", "molctl.cli")),
]


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the longest prefix (whole dotted parts) that names `module`."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            hit = module == prefix or (module.startswith(prefix + ".") and prefix != "molctl")
            if hit and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    arrows = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(module):
                arrows.append(f"{module} ({LAYERS[layer_of(module)][0]}) -> {target} ({LAYERS[layer_of(target)][0]})")
    return arrows


def test_every_module_has_a_layer():
    loose = [m for m in import_graph(ROOT) if layer_of(m) is None]
    assert not loose, f"modules in no layer of LAYERS (add them where they belong): {loose}"


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    arrows = upward_arrows(import_graph(ROOT))
    assert not arrows, "imports that run back up a layer:\n" + "\n".join(arrows)


def test_the_layer_scan_finds_an_import_inside_a_function(tmp_path):
    pkg = tmp_path / "molctl"
    (pkg / "engines").mkdir(parents=True)
    (pkg / "lifecycle").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "lifecycle" / "__init__.py").write_text("")
    (pkg / "engines" / "__init__.py").write_text("def f():\n    import molctl.lifecycle.start\n")
    (pkg / "lifecycle" / "start.py").write_text("import molctl.engines\n")
    assert upward_arrows(import_graph(tmp_path)) == ["molctl.engines (engines) -> molctl.lifecycle.start (operations)"]
