"""`check`'s engine category on a staging host without a GPU, with the GPU (CUDA) build of the
pinned vLLM as engine.python: vLLM fails "Failed to infer device type" before it lists a flag, so
the probe reads the version and the flags again with the device pinned to the CPU and says so
(tests/fake_vllm_cuda.py mimics the real vLLM's platform selection, with its sources)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from molctl.checks import check_profile
from molctl.checks.result import Probes
from molctl.profiles import profile_dirs
from tests.fake_vllm import fake_vllm, profile_flags
from tests.fake_vllm_cuda import fake_vllm_cuda

SKIP_ALL_BUT_ENGINE = ("gpu", "model", "adapter", "template", "port", "state", "security")


def venv(root: Path) -> tuple[Path, Path]:
    """(python, site-packages) of a fresh venv without pip."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    return root / "bin" / "python", next((root / "lib").glob("python3*/site-packages"))


class Ctx:
    def __init__(self, state_dir):
        self.state_dir = state_dir

    def dirs(self):
        return profile_dirs()


def engine_checks(state_dir: Path, python: Path, profile: str = "venti") -> dict[str, tuple[str, str]]:
    report = check_profile(
        profile, Ctx(state_dir), [("engine.python", str(python))], SKIP_ALL_BUT_ENGINE, None, Probes(environ={})
    )
    return {c.id: (c.status, c.detail) for c in report.checks if c.id.startswith("engine.")}


@pytest.fixture(scope="module")
def cuda_build(tmp_path_factory) -> Path:
    python, site = venv(tmp_path_factory.mktemp("cuda-vllm"))
    fake_vllm_cuda(site, "0.24.0", sorted(set(profile_flags("venti")) | set(profile_flags("tall"))))
    return python


def test_the_fake_fails_like_vllm_unless_the_device_is_pinned(cuda_build):
    """The premise: without the pin, the API server's --help raises vLLM's error."""
    argv = [str(cuda_build), "-m", "vllm.entrypoints.openai.api_server", "--help"]
    plain = subprocess.run(argv, capture_output=True, text=True, env={})
    assert plain.returncode == 1 and "RuntimeError: Failed to infer device type" in plain.stderr
    pinned = subprocess.run(argv, capture_output=True, text=True, env={"VLLM_TARGET_DEVICE": "cpu"})
    assert pinned.returncode == 0 and "--tensor-parallel-size" in pinned.stdout, pinned.stderr


@pytest.mark.parametrize("profile", ["venti", "tall"])
def test_version_and_flags_are_read_with_the_device_pinned_to_the_cpu(cuda_build, state_dir, profile):
    checks = engine_checks(state_dir, cuda_build, profile)
    status, detail = checks["engine.package"]
    assert status == "pass" and "pinned to the CPU (VLLM_TARGET_DEVICE=cpu)" in detail, detail
    status, detail = checks["engine.version"]  # then what this version refuses, and how the proxy avoids it
    assert status == "pass" and detail.startswith("vllm 0.24.0 matches ==0.24.0"), detail
    assert checks["engine.flags"][0] == "pass" and checks["engine.flags"][1].startswith("all "), checks
    assert checks["engine.flags"][1].endswith("flags accepted by vllm 0.24.0")


def test_the_cached_answer_still_says_how_it_was_read(cuda_build, tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "cache").mkdir(mode=0o700)
    first = engine_checks(state, cuda_build)
    assert list((state / "cache").glob("engine-vllm-*.json")), "the probe's answer was not cached"
    assert engine_checks(state, cuda_build) == first and "pinned to the CPU" in first["engine.package"][1]


def test_a_vllm_that_cannot_be_pinned_fails_with_its_own_error(tmp_path):
    python, site = venv(tmp_path / "old")
    fake_vllm_cuda(site, "0.24.0", profile_flags("venti"), pinnable=False)
    checks = engine_checks(tmp_path, python)
    status, detail = checks["engine.package"]
    assert status == "fail" and "RuntimeError: Failed to infer device type" in detail, detail
    assert set(checks) == {"engine.package"}  # no version or flag verdict made up


def test_an_engine_that_finds_its_device_is_read_as_is(tmp_path):
    python, site = venv(tmp_path / "cpu")
    fake_vllm(site, "0.24.0", profile_flags("venti"))
    checks = engine_checks(tmp_path, python)
    assert checks["engine.package"] == ("pass", f"vllm importable by {python}")
    assert checks["engine.flags"][0] == "pass"
