"""gpu.driver compares the driver NVML reports with what the engine environment's CUDA runtime
needs (torch's `torch.version.cuda`, read under engine.python), by NVIDIA's compatibility table
(molctl/cudacompat.py cites it), and fails naming both versions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from molctl.checks import check_profile
from molctl.checks.result import Probes
from molctl.cudacompat import TorchBuild, driver_verdict
from molctl.probes import GpuDevice, GpuInventory, torch_build
from molctl.profiles import profile_dirs

GIB = 1024**3
GPU_ONLY = ("engine", "model", "adapter", "template", "port", "state", "security")


@pytest.mark.parametrize(
    "driver, cuda, status, words",
    [
        ("575.57.08", "13.0", "fail", ["575.57.08", "CUDA 13.0", ">= 580", "install driver 580 or later"]),
        ("580.95.05", "13.0", "pass", ["580.95.05", "CUDA 13.0"]),
        ("580.40.01", "13.0", "warn", ["580.40.01", "580.65.06", "minor version compatibility"]),
        ("520.61.05", "12.8", "fail", ["520.61.05", "CUDA 12.8", ">= 525.60.13"]),
        ("535.216.03", "12.8", "warn", ["535.216.03", "570.26", "CUDA 12.8"]),
        ("570.195.03", "12.8", "pass", []),
        ("450.80.02", "11.8", "pass", []),
        ("590.48.01", "12.4", "pass", []),  # a newer driver runs an older runtime
        ("580.95.05", "14.0", "warn", ["no known minimum driver for CUDA 14.x"]),
        ("580.95.05", "thirteen", "warn", ["not versions"]),
    ],
)
def test_driver_verdict_by_nvidias_table(driver, cuda, status, words):
    got, why = driver_verdict(driver, cuda)
    assert got == status, why
    assert all(w in why for w in words), why


class OneDriver:
    def __init__(self, driver: str):
        self.driver = driver

    def inventory(self):
        devices = tuple(GpuDevice(i, "NVIDIA H200", 141 * GIB, 140 * GIB) for i in range(8))
        return GpuInventory(self.driver, devices)


class Ctx:
    def __init__(self, state_dir):
        self.state_dir = state_dir

    def dirs(self):
        return profile_dirs()


def gpu_driver(state_dir, driver: str, build) -> tuple[str, str]:
    probes = Probes(gpu=OneDriver(driver), environ={}, torch_build=build)
    report = check_profile("venti", Ctx(state_dir), [], GPU_ONLY, None, probes)
    (row,) = [c for c in report.checks if c.id == "gpu.driver"]
    return row.status, row.detail


def test_an_old_driver_fails_check_naming_both_versions(state_dir):
    seen = []

    def build(python):
        seen.append(python)
        return TorchBuild("2.11.0+cu130", "13.0")

    status, detail = gpu_driver(state_dir, "575.57.08", build)
    assert status == "fail"
    assert "NVIDIA driver 575.57.08 is older than CUDA 13.0 needs (>= 580 for CUDA 13.x)" in detail
    assert f"torch 2.11.0+cu130 under {sys.executable}" in detail and seen == [sys.executable]
    assert gpu_driver(state_dir, "580.95.05", build)[0] == "pass"


def test_an_engine_environment_without_a_cuda_runtime_is_a_warning(state_dir):
    status, detail = gpu_driver(state_dir, "580.95.05", lambda python: TorchBuild("2.13.0+cpu", None))
    assert status == "warn" and "torch 2.13.0+cpu" in detail and "CPU build" in detail
    status, detail = gpu_driver(state_dir, "580.95.05", lambda python: None)
    assert status == "warn" and "has no torch" in detail

    def broken(python):
        raise OSError(f"{python} failed (exit 1): ImportError")

    status, detail = gpu_driver(state_dir, "580.95.05", broken)
    assert status == "warn" and "ImportError" in detail and "580.95.05" in detail


def test_torch_build_reads_version_py_without_importing_torch(tmp_path, monkeypatch):
    """A torch as its build lays it out (torch/version.py holds `__version__` and `cuda`, the
    values `torch.__version__` and `torch.version.cuda` report); its __init__ raises, so only
    reading version.py succeeds."""
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('libcudart.so.13: cannot open shared object file')\n")
    (fake / "version.py").write_text(
        "from typing import Optional\n\n__version__ = '2.11.0+cu130'\ndebug = False\n"
        "cuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    assert torch_build(sys.executable) == TorchBuild("2.11.0+cu130", "13.0")


def test_torch_build_of_an_interpreter_without_torch_or_of_none(tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    assert torch_build(str(bare / "bin" / "python")) is None
    with pytest.raises(OSError):
        torch_build(str(Path(tmp_path / "no-such-python")))
