"""Engine checks against throwaway interpreter environments holding a fake engine package that
reports a chosen version and argument set (the real probe script runs under that interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from molctl.checks import check_profile
from molctl.checks.result import Probes
from molctl.profiles import profile_dirs
from tests.fake_vllm import fake_vllm, profile_flags

SKIP_ALL_BUT_ENGINE = ("gpu", "model", "adapter", "port", "state", "security")


@pytest.fixture(scope="module")
def venv_factory(tmp_path_factory):
    base = tmp_path_factory.mktemp("venvs")
    made = {}

    def make(name: str) -> tuple[Path, Path]:
        """Returns (python, site-packages) of a fresh venv without pip."""
        if name not in made:
            root = base / name
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
            site = next((root / "lib").glob("python3*/site-packages"))
            made[name] = (root / "bin" / "python", site)
        return made[name]

    return make


def fake_sglang(site: Path, version: str, flags: list[str]) -> None:
    pkg = site / "sglang"
    (pkg / "srt").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('torchvision::nms does not exist')\n")  # like on a CPU host
    (pkg / "srt" / "server_args.py").write_text(
        "\n".join(f'parser.add_argument(\n    "--{f}", type=str)' for f in flags)
    )
    dist = site / f"sglang-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")


class Ctx:
    def __init__(self, state_dir):
        self.state_dir = state_dir

    def dirs(self):
        return profile_dirs()


def run_engine_check(state_dir, profile: str, python: Path, *sets):
    overrides = [("engine.python", str(python)), *sets]
    report = check_profile(profile, Ctx(state_dir), overrides, SKIP_ALL_BUT_ENGINE, None, Probes(environ={}))
    return report, {c.id: (c.status, c.detail) for c in report.checks}


def test_vllm_matching_version_and_flags(venv_factory, state_dir):
    python, site = venv_factory("vllm-ok")
    fake_vllm(site, "0.24.0+cu130", profile_flags("tall") + ["some-other-flag"])
    report, checks = run_engine_check(state_dir, "tall", python)
    assert report.ok, checks
    assert checks["engine.version"][0] == "pass" and "0.24.0+cu130" in checks["engine.version"][1]
    assert checks["engine.flags"][0] == "pass"


def test_vllm_wrong_version(venv_factory, state_dir):
    python, site = venv_factory("vllm-new")
    fake_vllm(site, "0.25.1", profile_flags("tall"))
    report, checks = run_engine_check(state_dir, "tall", python)
    assert not report.ok
    assert checks["engine.version"] == ("fail", f"vllm 0.25.1 under {python} does not match engine.version ==0.24.0")


def test_vllm_flag_removed_in_installed_version(venv_factory, state_dir):
    python, site = venv_factory("vllm-noflag")
    fake_vllm(site, "0.24.0", [f for f in profile_flags("venti") if f != "no-async-scheduling"])
    report, checks = run_engine_check(state_dir, "venti", python)
    assert not report.ok
    status, detail = checks["engine.flags"]
    assert status == "fail" and "--no-async-scheduling" in detail and "venti.yaml" in detail


def test_typo_in_profile_flag(venv_factory, state_dir):
    python, site = venv_factory("vllm-ok2")
    fake_vllm(site, "0.24.0", profile_flags("tall"))
    report, checks = run_engine_check(state_dir, "tall", python, ("engine.args.max-lora-rnak", 64))
    assert "--max-lora-rnak" in checks["engine.flags"][1]


def test_engine_package_missing(venv_factory, state_dir):
    python, _ = venv_factory("empty")
    report, checks = run_engine_check(state_dir, "tall", python)
    assert not report.ok
    assert checks["engine.package"][0] == "fail" and str(python) in checks["engine.package"][1]


def test_engine_python_does_not_exist(state_dir, tmp_path):
    report, checks = run_engine_check(state_dir, "tall", tmp_path / "nope" / "python")
    assert checks["engine.package"][0] == "fail" and "does not exist" in checks["engine.package"][1]


def test_sglang_flags_read_without_importing(venv_factory, state_dir):
    python, site = venv_factory("sglang")
    fake_sglang(site, "0.5.13.post1", profile_flags("venti-sglang"))
    report, checks = run_engine_check(state_dir, "venti-sglang", python)
    assert report.ok, checks
    report, checks = run_engine_check(state_dir, "venti-sglang", python, ("engine.args.enable-magic", True))
    assert "--enable-magic" in checks["engine.flags"][1]
    report, checks = run_engine_check(state_dir, "venti-sglang", python, ("engine.version", "==0.5.23"))
    assert checks["engine.version"][0] == "fail"


@pytest.mark.parametrize("content", ["[1, 2]", '{"version": "0.24.0", "flags": 5}', "null"])
def test_a_damaged_engine_cache_file_is_probed_again(venv_factory, state_dir, content):
    """A cache file of another JSON shape (a hand edit, another molctl's format) made `check` and
    `up` end in a TypeError traceback; it is a cache miss like an unparsable one."""
    python, site = venv_factory("vllm-cache")
    if not (site / "vllm").exists():
        fake_vllm(site, "0.24.0", profile_flags("tall"))
    assert run_engine_check(state_dir, "tall", python)[0].ok
    caches = list((state_dir / "cache").glob("engine-vllm-*.json"))
    assert caches
    for path in caches:
        path.write_text(content)
    report, checks = run_engine_check(state_dir, "tall", python)
    assert report.ok and checks["engine.version"][0] == "pass", checks


def test_the_fingerprint_of_this_interpreter_is_taken_in_process_and_equals_the_subprocess_one(
    venv_factory, monkeypatch
):
    """`check` fingerprints the engine package to find its cached probe; when engine.python is the
    interpreter running molctl (the demo's venv), the fingerprint is computed in-process (no
    interpreter start) and must be exactly what the probe script prints under that interpreter.
    Another venv whose python resolves to the same base interpreter is NOT this interpreter."""
    from molctl.engines import base

    assert base.is_this_interpreter(sys.executable)
    other, _ = venv_factory("fingerprint-other")
    assert not base.is_this_interpreter(str(other))
    calls = []
    real_run = subprocess.run
    monkeypatch.setattr(base.subprocess, "run", lambda *a, **k: calls.append(a) or real_run(*a, **k))
    here = base.install_fingerprint(sys.executable, "json")
    assert calls == []
    monkeypatch.setattr(base, "is_this_interpreter", lambda python: False)
    there = base.install_fingerprint(sys.executable, "json")
    assert len(calls) == 1
    assert here == there and here["origin"].endswith("__init__.py")
    assert "origin" not in base.install_fingerprint(sys.executable, "no_such_package_molctl")


def fake_opentelemetry(site: Path, *modules: str) -> None:
    """Empty modules at the dotted names the engine's tracing imports (what find_spec looks for)."""
    for name in modules:
        *pkgs, leaf = name.split(".")
        d = site
        for p in pkgs:
            d = d / p
            d.mkdir(exist_ok=True)
            (d / "__init__.py").touch()
        (d / f"{leaf}.py").touch()


def test_a_traces_endpoint_fails_check_when_the_engine_lacks_opentelemetry(venv_factory, state_dir):
    """vLLM refuses to start with --otlp-traces-endpoint and no OpenTelemetry (vllm/tracing/otel.py,
    is_otel_available); SGLang needs its `tracing` extra: `check` says so before the load."""
    python, site = venv_factory("vllm-no-otel")
    fake_vllm(site, "0.24.0", profile_flags("tall") + ["otlp-traces-endpoint"])
    endpoint = ("engine.otlp_traces_endpoint", "http://127.0.0.1:4317")
    report, checks = run_engine_check(state_dir, "tall", python, endpoint)
    status, detail = checks["engine.tracing"]
    assert status == "fail" and not report.ok
    assert "opentelemetry.sdk.trace" in detail and "pip install opentelemetry-sdk" in detail and str(python) in detail
    _, without = run_engine_check(state_dir, "tall", python)
    assert "engine.tracing" not in without


def test_a_traces_endpoint_passes_check_with_opentelemetry_installed(venv_factory, state_dir):
    from molctl.engines.vllm import ENGINE

    python, site = venv_factory("vllm-otel")
    fake_vllm(site, "0.24.0", profile_flags("tall") + ["otlp-traces-endpoint"])
    fake_opentelemetry(site, *ENGINE.trace_modules)
    _, checks = run_engine_check(state_dir, "tall", python, ("engine.otlp_traces_endpoint", "http://127.0.0.1:4317"))
    assert checks["engine.tracing"][0] == "pass", checks


def test_sglang_without_its_tracing_extra_fails_check(venv_factory, state_dir):
    python, site = venv_factory("sglang-no-otel")
    fake_sglang(site, "0.5.13.post1", profile_flags("venti-sglang") + ["enable-trace", "otlp-traces-endpoint"])
    _, checks = run_engine_check(
        state_dir, "venti-sglang", python, ("engine.otlp_traces_endpoint", "http://127.0.0.1:4317")
    )
    status, detail = checks["engine.tracing"]
    assert status == "fail" and "sglang[tracing]" in detail


def test_check_says_what_the_proxy_does_for_a_version_that_refuses_overflowing_limits(venv_factory, state_dir):
    """The version facts live in the engine module, keyed by the version `check` reads: 0.24.0 refuses
    prompt + max_tokens over the window (vllm/renderers/params.py), 0.32.0 cuts (api_utils.py)."""
    python, site = venv_factory("vllm-facts")
    fake_vllm(site, "0.24.0", profile_flags("tall"))
    _, old = run_engine_check(state_dir, "tall", python)
    assert "refuses prompt + max_tokens" in old["engine.version"][1]
    python, site = venv_factory("vllm-facts-new")
    fake_vllm(site, "0.32.0", profile_flags("tall"))
    _, new = run_engine_check(state_dir, "tall", python, ("engine.version", "==0.32.0"))
    assert new["engine.version"][0] == "pass" and "refuses" not in new["engine.version"][1]
