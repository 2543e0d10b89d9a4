"""molctl/proxy/__init__.py's docstring maps every module of the proxy (its subpackages' too, by
dotted name), one line each, so a newcomer finds their way from it."""

from __future__ import annotations

from pathlib import Path

import molctl.proxy

PROXY = Path(molctl.proxy.__file__).parent


def test_the_proxy_package_docstring_names_every_module_once():
    lines = molctl.proxy.__doc__.splitlines()
    for path in sorted(PROXY.rglob("*.py")):
        if path.stem == "__init__":
            continue
        name = ".".join(path.relative_to(PROXY).with_suffix("").parts)
        entries = [ln for ln in lines if ln.startswith(f"- `{name}`: ")]
        assert len(entries) == 1, f"molctl/proxy/__init__.py: no one-line entry '- `{name}`: ...'"
