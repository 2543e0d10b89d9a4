"""A fake vLLM for the engine and lock checks (tests/checks/): `fake_vllm(site, version, flags)` writes
a `vllm` package into a site-packages folder, reporting `version`, whose api_server parses exactly
`flags`; `profile_flags(name)` is the flag list a shipped profile starts its engine with."""

from __future__ import annotations

import textwrap
from pathlib import Path

from molctl.engines import get_engine
from molctl.profiles import load_profile, profile_dirs


def fake_vllm(site: Path, version: str, flags: list[str]) -> None:
    pkg = site / "vllm"
    (pkg / "entrypoints" / "openai").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (pkg / "entrypoints" / "__init__.py").write_text("")
    (pkg / "entrypoints" / "openai" / "__init__.py").write_text("")
    (pkg / "entrypoints" / "openai" / "api_server.py").write_text(
        textwrap.dedent(f"""
        import argparse
        parser = argparse.ArgumentParser()
        for flag in {flags!r}:
            parser.add_argument("--" + flag, nargs="*")
        if __name__ == "__main__":
            parser.parse_args()
    """)
    )


def profile_flags(name: str) -> list[str]:
    p = load_profile(name, profile_dirs())
    return get_engine(p.engine.kind).profile_flags(p)
