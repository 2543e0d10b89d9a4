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


def nvml_env(host, where: str) -> dict:
    """`status`/`down` (processes of their own) import the fake binding first; it lists the
    stack's engine on GPU 0, so an NVML that answers shows it there."""
    engine = host.records()["engine"].pid
    return {"PYTHONPATH": str(FAKE_NVML), "FAKE_NVML": where, "FAKE_NVML_PIDS": str(engine)}


def test_status_and_down_see_the_fake_when_it_answers(host):
    """The premise of the next test: the commands read the fake (status shows the engine's GPU
    memory, down keeps the record while NVML lists the engine)."""
    assert host.up().exit_code == ExitStatus.OK
    r = host.molctl("status", "tiny", "--json", env=nvml_env(host, ""))
    (stack,) = json.loads(r.stdout)["stacks"]
    assert stack["gpus"] == [{"index": 0, "used_bytes": 1 << 30, "total_bytes": 141 << 30}], stack
    r = host.molctl("down", env=nvml_env(host, ""))
    assert r.exit_code != ExitStatus.OK and "NVML still shows process(es) of the stack" in r.stderr, r.stderr


@pytest.mark.parametrize("where", sorted(CASES))
def test_status_and_down_go_on_without_the_gpu_view(host, where):
    """`status` and `down` read a running stack and stop it as if the host had no GPU view, with
    no traceback."""
    assert host.up().exit_code == ExitStatus.OK
    nvml = nvml_env(host, where)
    r = host.molctl("status", "tiny", "--json", env=nvml)
    assert r.exit_code == ExitStatus.OK and "Traceback" not in r.stderr, r.stderr
    (stack,) = json.loads(r.stdout)["stacks"]
    assert stack["state"] == "ready" and stack.get("gpus", []) == [], stack
    r = host.molctl("down", env=nvml)
    assert r.exit_code == ExitStatus.OK and "Traceback" not in r.stderr, r.stderr
    assert host.records() == {}
