"""GPU (fake NVML), port, state-dir and security checks."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from molctl.checks import check_profile
from molctl.checks.result import Probes
from molctl.probes import GpuDevice, GpuInventory, GpuProcess, GpuUnavailable
from molctl.profiles import profile_dirs
from tests.layouts import tall_layout

GIB = 1024**3


class FakeNvml:
    def __init__(self, devices=8, total=141 * GIB, free=140 * GIB, processes=None, error=None):
        self.devices, self.total, self.free, self.processes, self.error = devices, total, free, processes or {}, error

    def inventory(self):
        if self.error:
            raise GpuUnavailable(self.error)
        return GpuInventory(
            "580.95.05",
            tuple(
                GpuDevice(
                    i,
                    "NVIDIA H200",
                    self.total,
                    self.free(i) if callable(self.free) else self.free,
                    tuple(self.processes.get(i, ())),
                )
                for i in range(self.devices)
            ),
        )


class Ctx:
    def __init__(self, state_dir: Path):
        self.state_dir = state_dir

    def dirs(self):
        return profile_dirs()


@pytest.fixture
def run(state_dir, free_ports, monkeypatch):
    monkeypatch.delenv("MOLCTL_PROFILES_DIR", raising=False)

    def go(*, gpu=None, skip=("engine", "model", "adapter"), sets=(), api_key_file=None, environ=None, profile="tall"):
        probes = Probes(gpu=gpu or FakeNvml(), environ=environ if environ is not None else {})
        overrides = [("engine.port", free_ports[0]), ("proxy.port", free_ports[1]), *sets]
        report = check_profile(profile, Ctx(state_dir), overrides, skip, api_key_file, probes)
        return report, {c.id: (c.status, c.detail) for c in report.checks}

    return go


def test_eight_healthy_gpus_pass(run):
    report, checks = run()
    assert report.ok, checks
    assert checks["gpu.count"][0] == "pass"
    assert checks["gpu.memory"][0] == "pass"
    assert checks["gpu.processes"][0] == "pass"
    assert "580.95.05" in checks["gpu.driver"][1]


def test_too_few_gpus(run):
    report, checks = run(gpu=FakeNvml(devices=4))
    assert not report.ok
    assert checks["gpu.count"] == ("fail", "4 GPU(s) visible, profile tall needs engine.gpus=8")


def test_no_driver(run):
    report, checks = run(gpu=FakeNvml(error="NVML init failed: Driver Not Loaded"))
    assert not report.ok
    assert "Driver Not Loaded" in checks["gpu.driver"][1] and "--skip gpu" in checks["gpu.driver"][1]


def test_low_free_memory_on_one_gpu(run):
    report, checks = run(gpu=FakeNvml(free=lambda i: 40 * GIB if i == 5 else 140 * GIB))
    assert not report.ok
    status, detail = checks["gpu.memory"]
    assert status == "fail" and "GPU 5: 40.0 GiB free" in detail and "0.915" in detail


def test_foreign_process_holding_memory(run):
    orphan = GpuProcess(4242, "VLLM::Worker_TP3", 70 * GIB)
    report, checks = run(gpu=FakeNvml(processes={3: [orphan]}))
    assert not report.ok
    status, detail = checks["gpu.processes"]
    assert status == "fail"
    assert "GPU 3: pid 4242 VLLM::Worker_TP3 using 71680 MiB" in detail


def test_gpu_selection_follows_cuda_visible_devices(run):
    orphan = GpuProcess(4242, "python", GIB)
    # 16 GPUs, the orphan sits on GPU 12, the profile uses 0-7: not our problem
    report, checks = run(gpu=FakeNvml(devices=16, processes={12: [orphan]}))
    assert report.ok, checks
    report, checks = run(
        gpu=FakeNvml(devices=16, processes={12: [orphan]}), environ={"CUDA_VISIBLE_DEVICES": "8,9,10,11,12,13,14,15"}
    )
    assert checks["gpu.processes"][0] == "fail"


def test_port_held_by_test_socket(run, free_ports):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_ports[0]))
        sock.listen()
        report, checks = run(skip=("engine", "gpu", "model", "adapter"))
    assert not report.ok
    status, detail = checks["port.engine"]
    assert status == "fail"
    assert f"127.0.0.1:{free_ports[0]}" in detail and f"pid {os.getpid()}" in detail
    assert checks["port.proxy"][0] == "pass"


def test_port_held_by_own_stack_passes(state_dir, free_ports, monkeypatch):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_ports[1]))
        sock.listen()
        probes = Probes(gpu=FakeNvml(), environ={})
        report = check_profile(
            "tall",
            Ctx(state_dir),
            [("engine.port", free_ports[0]), ("proxy.port", free_ports[1])],
            ("engine", "gpu", "model", "adapter"),
            None,
            probes,
        )
        # no record: foreign
        assert {c.id: c.status for c in report.checks}["port.proxy"] == "fail"
        from molctl.checks import run_checks
        from molctl.profiles import load_profile

        profile = load_profile("tall", profile_dirs(), [("engine.port", free_ports[0]), ("proxy.port", free_ports[1])])
        probes.stack_pids = lambda: {os.getpid()}
        report = run_checks(profile, probes, ("engine", "gpu", "model", "adapter"))
        status = {c.id: (c.status, c.detail) for c in report.checks}["port.proxy"]
        assert status[0] == "pass" and "this profile's running proxy" in status[1]


def test_world_readable_key_file(run, tmp_path):
    key = tmp_path / "key"
    key.write_text("sk-test")
    key.chmod(0o644)
    report, checks = run(skip=("engine", "gpu", "model", "adapter", "port"), api_key_file=key)
    assert not report.ok
    assert checks["security.api_key_file"][0] == "fail"
    assert str(key) in checks["security.api_key_file"][1] and "0644" in checks["security.api_key_file"][1]
    key.chmod(0o600)
    report, checks = run(skip=("engine", "gpu", "model", "adapter", "port"), api_key_file=key)
    assert report.ok and checks["security.api_key_file"][0] == "pass"


def test_runtime_lora_updating_fails(run):
    report, checks = run(
        skip=("engine", "gpu", "model", "adapter", "port"), environ={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    )
    assert not report.ok
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in checks["security.runtime_lora"][1]
    report, checks = run(
        skip=("engine", "gpu", "model", "adapter", "port"),
        sets=[("engine.env.VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")],
    )
    assert checks["security.runtime_lora"][0] == "fail" and "engine.env" in checks["security.runtime_lora"][1]


def test_engine_host_not_loopback_warns(run):
    report, checks = run(skip=("engine", "gpu", "model", "adapter", "port"), sets=[("engine.host", "0.0.0.0")])
    assert report.ok
    assert checks["security.engine_host"][0] == "warn"


def test_state_dir_with_bad_permissions(run, state_dir):
    state_dir.chmod(0o755)
    report, checks = run(skip=("engine", "gpu", "model", "adapter", "port", "security"))
    assert not report.ok
    assert checks["state.dir"] == (
        "fail",
        f"state dir {state_dir} has mode 0755, expected 0700 (chmod 700 {state_dir})",
    )


def test_full_check_with_fake_nvml_and_layout(run, tmp_path):
    tall_layout(tmp_path / "m")
    report, checks = run(skip=("engine",), sets=[("model_root", str(tmp_path / "m"))])
    assert report.ok, [c for c in report.checks if c.status == "fail"]


def test_memory_held_by_the_profiles_own_stack_counts_as_available(state_dir, free_ports):
    from molctl.checks import run_checks
    from molctl.profiles import load_profile

    ours = GpuProcess(777, "VLLM::Worker_TP0", 128 * GIB)
    gpu = FakeNvml(free=5 * GIB, processes={i: [ours] for i in range(8)})
    profile = load_profile("tall", profile_dirs(), [("engine.port", free_ports[0]), ("proxy.port", free_ports[1])])
    probes = Probes(gpu=gpu, environ={}, stack_pids=lambda: {777})
    checks = {c.id: c.status for c in run_checks(profile, probes, ("engine", "model", "adapter")).checks}
    assert checks["gpu.memory"] == "pass" and checks["gpu.processes"] == "pass"
    probes.stack_pids = lambda: set()
    checks = {c.id: c.status for c in run_checks(profile, probes, ("engine", "model", "adapter")).checks}
    assert checks["gpu.memory"] == "fail" and checks["gpu.processes"] == "fail"


def test_metrics_port_is_checked_when_set(run):
    from tests.helpers import free_port

    report, checks = run(skip=("engine", "gpu", "model", "adapter"))
    assert "port.metrics" not in checks  # no proxy.metrics_port: no listener, nothing to check
    metrics = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", metrics))
        sock.listen()
        report, checks = run(skip=("engine", "gpu", "model", "adapter"), sets=[("proxy.metrics_port", metrics)])
    assert not report.ok
    status, detail = checks["port.metrics"]
    assert status == "fail" and f"127.0.0.1:{metrics} (proxy.metrics_port)" in detail and f"pid {os.getpid()}" in detail
    report, checks = run(skip=("engine", "gpu", "model", "adapter"), sets=[("proxy.metrics_port", metrics)])
    assert checks["port.metrics"][0] == "pass"


@pytest.mark.parametrize(
    "content, expected", [(b"# Ansible managed\n", "holds no key"), (b"\xff\xfe\x00", "not UTF-8")]
)
def test_a_key_file_the_proxy_would_refuse_fails_the_check(run, tmp_path, content, expected):
    """The check reads the key file as the proxy does: comments only is no key; binary is one line."""
    key = tmp_path / "key"
    key.write_bytes(content)
    key.chmod(0o600)
    report, checks = run(skip=("engine", "gpu", "model", "adapter", "port"), api_key_file=key)
    assert checks["security.api_key_file"][0] == "fail" and expected in checks["security.api_key_file"][1]


@pytest.mark.parametrize("category", ["profile", "lock", "bogus"])
def test_skip_of_an_unskippable_category_is_usage(molctl, category):
    """`--skip profile` was accepted and ignored (exit 0), while `--help` offered `--skip lock`,
    which was refused: the contract's list is engine gpu model adapter template port state security."""
    r = molctl("check", "tiny", "--skip", category, "--skip", "engine", "--skip", "gpu")
    assert r.exit_code == 2 and f"--skip {category!r}: expected one of engine, gpu" in r.stderr, r.stderr
    assert "lock" not in molctl("check", "--help").stdout.split("--skip")[1].split("--")[0]


def test_a_hung_nvml_is_given_up_not_waited_for(monkeypatch):
    """From the status review (not fixed there): NVML calls hang on a failing GPU or driver, and
    `status`, `check` and `up` called NvmlProbe with no time limit, so one hung GPU hung every
    molctl command that looks at GPUs. The inventory is now given up after its timeout with a
    GpuUnavailable that says why; an NVML that answers is read as before."""
    import sys
    import threading
    import types

    from molctl.probes import GpuUnavailable, NvmlProbe

    release = threading.Event()
    stub = types.ModuleType("pynvml")
    stub.NVMLError = type("NVMLError", (Exception,), {})
    stub.nvmlInit = lambda: release.wait(30)  # a hung driver call
    stub.nvmlShutdown = lambda: None
    stub.nvmlSystemGetDriverVersion = lambda: b"580.1"
    stub.nvmlDeviceGetCount = lambda: 0
    monkeypatch.setitem(sys.modules, "pynvml", stub)
    try:
        with pytest.raises(GpuUnavailable, match="NVML did not answer within 0.2 s"):
            NvmlProbe(timeout_s=0.2).inventory()
    finally:
        release.set()
    inventory = NvmlProbe(timeout_s=5).inventory()  # answering now
    monkeypatch.setenv("MOLCTL_NVML_TIMEOUT_S", "42")
    assert NvmlProbe().timeout_s == 42  # an 8-GPU host without persistence mode may need longer
    monkeypatch.setenv("MOLCTL_NVML_TIMEOUT_S", "nan")
    assert NvmlProbe().timeout_s == 30
    assert inventory.driver_version == "580.1" and inventory.devices == ()
    stub.nvmlInit = lambda: (_ for _ in ()).throw(stub.NVMLError("Driver Not Loaded"))
    with pytest.raises(GpuUnavailable, match="NVML init failed: Driver Not Loaded"):
        NvmlProbe().inventory()  # an NVML error still reaches the caller as before


def test_a_secret_engine_flag_warns_that_every_local_user_can_read_it(run):
    """From the security review (not fixed there): `render` refuses an engine flag carrying a
    secret, but `up` put `--api-key sk-...` on the engine's command line, world-readable through ps,
    without a word. check (and up's preflight) now warn, naming the flag and the way out."""
    skip = ("engine", "gpu", "model", "adapter", "port")
    report, checks = run(skip=skip)
    assert checks["security.engine_args"][0] == "pass"
    report, checks = run(
        skip=skip, sets=[("engine.args.api-key", "sk-engine-secret"), ("engine.args.max-num-batched-tokens", 8192)]
    )
    assert report.ok and checks["security.engine_args"][0] == "warn"
    detail = checks["security.engine_args"][1]
    assert "engine.args.api-key" in detail and "VLLM_API_KEY" in detail and "sk-engine-secret" not in detail
    assert "max-num-batched-tokens" not in detail
    report, checks = run(skip=skip, sets=[("engine.args.download-dir", "https://u:pw@mirror/x")])
    assert checks["security.engine_args"][0] == "warn" and "pw@" not in checks["security.engine_args"][1]


def test_a_key_file_owned_by_another_user_warns(run, tmp_path, monkeypatch):
    """From the security review (not fixed there): the key file's owner was not looked at, so a
    0600 file of another (non-root) user, read by the operator's proxy, let that user choose the
    accepted keys. Owned by you or by root: pass; by anyone else: warn naming the owner."""
    key = tmp_path / "key"
    key.write_text("sk-test\n")
    key.chmod(0o600)
    skip = ("engine", "gpu", "model", "adapter", "port", "state")
    report, checks = run(skip=skip, api_key_file=key)
    assert checks["security.api_key_file"][0] == "pass"
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 4343)  # the file now belongs to someone else...
    if me == 0:  # ...unless that is root, whose files are trusted: give it to a third uid
        os.chown(key, 4242, -1)
    report, checks = run(skip=skip, api_key_file=key)
    assert report.ok and checks["security.api_key_file"][0] == "warn"
    assert "neither you nor root" in checks["security.api_key_file"][1]
