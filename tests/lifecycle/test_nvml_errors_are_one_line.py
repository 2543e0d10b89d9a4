"""Every NVML error, at any call, is a check result (`check`) or nothing worse than the GPU
information left out (`status`, `down`): never a traceback. NVML here is the real `NvmlProbe`
over a fake nvidia-ml-py (tests/fake_nvml/pynvml.py, which cites the binding it mimics) failing
where each case says: at init, a later NVMLError (a GPU lost mid-read), nvidia-ml-py 13's
NVMLLibraryMismatchError (no NVMLError subclass), and an error that is not NVML's own."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from molctl.errors import ExitStatus

FAKE_NVML = Path(__file__).resolve().parents[1] / "fake_nvml"

CASES = {
    "init:DriverNotLoaded": "NVML init failed: Driver Not Loaded (NVMLError_DriverNotLoaded)",
    "init:LibraryNotFound": "NVML init failed: NVML Shared Library Not Found (NVMLError_LibraryNotFound)",
    "driver:Uninitialized": "NVML failed reading the driver version: Uninitialized (NVMLError_Uninitialized)",
    "memory:GpuIsLost": "NVML failed reading GPU 0: GPU is lost (NVMLError_GpuIsLost)",
    "processes:mismatch": "NVML failed reading GPU 0's compute processes: Unversioned function called and the "
    "pyNVML version does not match the NVML lib version.",
    "count:OSError": "NVML failed: OSError: [Errno 5] Input/output error",
}
GPU_ONLY = ("--skip", "engine", "--skip", "model", "--skip", "adapter", "--skip", "template")


@pytest.fixture
def fake_nvml(monkeypatch):
    """The fake binding as `pynvml` in this interpreter; returns a setter for its failure."""
    spec = importlib.util.spec_from_file_location("pynvml", FAKE_NVML / "pynvml.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return lambda where: monkeypatch.setenv("FAKE_NVML", where)


@pytest.mark.parametrize("where", sorted(CASES))
def test_check_reports_the_nvml_error_as_gpu_driver(molctl, fake_nvml, where):
    fake_nvml(where)
    r = molctl("check", "tall", *GPU_ONLY, "--json")
    assert r.exit_code == ExitStatus.CHECK_FAILED and "Traceback" not in r.stderr, r.stderr
    checks = {c["id"]: c for c in r.json()["checks"]}
    assert checks["gpu.driver"]["status"] == "fail"
    assert checks["gpu.driver"]["detail"].startswith(CASES[where]), checks["gpu.driver"]["detail"]
    assert "profile tall needs 8 GPU(s)" in checks["gpu.driver"]["detail"]


def test_a_failing_shutdown_keeps_what_was_read(molctl, fake_nvml):
    fake_nvml("shutdown:GpuIsLost")
    r = molctl("check", "tall", *GPU_ONLY, "--json")
    checks = {c["id"]: c for c in r.json()["checks"]}
    assert checks["gpu.count"] == {"id": "gpu.count", "status": "pass", "detail": "8 GPU(s), 8 needed"}


def test_the_fake_answers_like_a_healthy_nvml_when_told_nothing(molctl, fake_nvml):
    """The premise of the cases above: no failure asked, every GPU check passes on the fake."""
    fake_nvml("")
    r = molctl("check", "tall", *GPU_ONLY, "--json")
    checks = {c["id"]: c["status"] for c in r.json()["checks"] if c["id"].startswith("gpu.")}
    assert checks["gpu.count"] == checks["gpu.memory"] == checks["gpu.processes"] == "pass", checks


@pytest.mark.parametrize("where", sorted(CASES))
def test_status_and_down_go_on_without_the_gpu_view(host, where):
    """`status` and `down` (processes of their own, importing the fake binding first) read a
    running stack and stop it as if the host had no GPU view, with no traceback."""
    assert host.up().exit_code == ExitStatus.OK
    nvml = {"PYTHONPATH": str(FAKE_NVML), "FAKE_NVML": where}
    r = host.molctl("status", "tiny", "--json", env=nvml)
    assert r.exit_code == ExitStatus.OK and "Traceback" not in r.stderr, r.stderr
    (stack,) = json.loads(r.stdout)["stacks"]
    assert stack["state"] == "ready" and stack.get("gpus", []) == [], stack
    r = host.molctl("down", env=nvml)
    assert r.exit_code == ExitStatus.OK and "Traceback" not in r.stderr, r.stderr
    assert host.records() == {}
