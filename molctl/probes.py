"""Probes of the host that checks and lifecycle code receive as arguments, so tests can inject
fakes: GPUs through NVML, TCP ports through bind(), processes through psutil."""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass, field
from typing import Protocol


class GpuUnavailable(Exception):
    """NVML cannot be used on this host (no driver, no library); the message says why."""


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_bytes: int | None


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class GpuInventory:
    driver_version: str
    devices: tuple[GpuDevice, ...] = field(default_factory=tuple)


class GpuProbe(Protocol):
    def inventory(self) -> GpuInventory: ...


def _process_name(pid: int) -> str:
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.name() or " ".join(proc.cmdline()[:1])
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"


class NvmlProbe:
    """The real GPU probe (nvidia-ml-py). NVML calls can hang on a failing GPU or driver (an Xid
    fault, a GPU fallen off the bus): the inventory is read in a daemon thread and given up after
    `timeout_s`, a GpuUnavailable saying so, so `status`, `check` and `up` never hang on it."""

    def __init__(self, timeout_s: float | None = None):
        # MOLCTL_NVML_TIMEOUT_S overrides the default: a host without persistence mode initialises
        # every GPU on the first NVML call, several seconds on an 8-GPU machine
        if timeout_s is None:
            try:
                timeout_s = float(os.environ.get("MOLCTL_NVML_TIMEOUT_S", "30"))
            except ValueError:
                timeout_s = 30.0
        self.timeout_s = timeout_s if timeout_s > 0 else 30.0  # NaN and negatives too

    def inventory(self) -> GpuInventory:
        import threading

        result: list[GpuInventory | BaseException] = []

        def read() -> None:
            try:
                result.append(self._inventory())
            except BaseException as exc:  # handed to the caller's thread
                result.append(exc)

        worker = threading.Thread(target=read, name="nvml-inventory", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if not result:
            raise GpuUnavailable(
                f"NVML did not answer within {self.timeout_s:g} s: a GPU or the driver may be hung "
                "(check nvidia-smi, and dmesg for Xid errors; without persistence mode the first "
                "call initialises every GPU: nvidia-smi -pm 1, or raise MOLCTL_NVML_TIMEOUT_S)"
            )
        answer = result[0]
        if isinstance(answer, GpuInventory):
            return answer
        if isinstance(answer, Exception) and not isinstance(answer, GpuUnavailable):
            # whatever else the binding raised (ctypes, a decode): one line, never a traceback
            raise GpuUnavailable(f"NVML failed: {type(answer).__name__}: {answer}") from None
        raise answer

    def _inventory(self) -> GpuInventory:
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a dependency
            raise GpuUnavailable(f"nvidia-ml-py is not installed: {exc}") from None
        errors = nvml_errors(pynvml)
        try:
            pynvml.nvmlInit()
        except errors as exc:
            raise GpuUnavailable(f"NVML init failed: {_nvml_text(exc)} (no NVIDIA driver on this host?)") from None
        step = "the driver version"
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else driver
            step = "the GPU count"
            devices = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                step = f"GPU {i}"
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(handle)
                name = name.decode() if isinstance(name, bytes) else name
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
                step = f"GPU {i}'s compute processes"
                procs = []
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = getattr(p, "usedGpuMemory", None)
                    procs.append(GpuProcess(p.pid, _process_name(p.pid), used if isinstance(used, int) else None))
                devices.append(GpuDevice(i, name, int(mem.total), int(mem.free), tuple(procs)))
            return GpuInventory(driver, tuple(devices))
        except errors as exc:
            raise GpuUnavailable(f"NVML failed reading {step}: {_nvml_text(exc)}") from None
        finally:
            try:
                pynvml.nvmlShutdown()
            except errors:
                pass  # what was read stands; a failure to read has its own message


def nvml_errors(pynvml) -> tuple[type[BaseException], ...]:
    """What nvidia-ml-py raises: `NVMLError` and its per-code subclasses (`NVMLError_GpuIsLost`,
    `NVMLError_DriverNotLoaded`, ... made by `_extractNVMLErrorsAsClasses`), and (nvidia-ml-py 13)
    `NVMLLibraryMismatchError`, which is no NVMLError (pynvml.py: `class
    NVMLLibraryMismatchError(Exception)`): the unversioned calls such as
    `nvmlDeviceGetComputeRunningProcesses` raise it when the driver's libnvidia-ml lacks the
    versioned function the binding picked (`throwOnVersionMismatch`), i.e. a driver older than
    the binding."""
    mismatch = getattr(pynvml, "NVMLLibraryMismatchError", None)
    return (pynvml.NVMLError, *((mismatch,) if isinstance(mismatch, type) else ()))


def _nvml_text(exc: BaseException) -> str:
    """`GPU is lost (NVMLError_GpuIsLost)`: NVML's message and the binding's class name."""
    text = " ".join(str(exc).split()) or "no message"
    return f"{text} ({type(exc).__name__})"


class PortProbe:
    """Port availability by a plain bind() (no SO_REUSEPORT), and the holder through psutil."""

    def is_free(self, host: str, port: int) -> bool:
        """A plain bind() (no SO_REUSEADDR/SO_REUSEPORT: vLLM binds with those long before it
        listens). A port whose only sockets are ownerless closing leftovers of a stopped server
        (TIME_WAIT, FIN_WAIT...) counts as free: the servers we start bind with SO_REUSEADDR."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return self._only_time_wait(port)
                if exc.errno == errno.EACCES:
                    return False
                raise
        return True

    def _only_time_wait(self, port: int) -> bool:
        import psutil

        try:
            conns = [c for c in psutil.net_connections(kind="tcp") if c.laddr and c.laddr.port == port]
        except psutil.AccessDenied:
            return False
        closing = {
            psutil.CONN_TIME_WAIT,
            psutil.CONN_FIN_WAIT1,
            psutil.CONN_FIN_WAIT2,
            psutil.CONN_CLOSING,
            psutil.CONN_LAST_ACK,
        }
        return bool(conns) and all(c.status in closing and not c.pid for c in conns)

    def holder(self, port: int) -> tuple[int, str] | None:
        import psutil

        try:
            conns = psutil.net_connections(kind="inet")
        except psutil.AccessDenied:
            return None
        for conn in conns:
            if conn.laddr and conn.laddr.port == port and conn.pid and conn.status == "LISTEN":
                return conn.pid, _process_name(conn.pid)
        for conn in conns:
            if conn.laddr and conn.laddr.port == port and conn.pid:
                return conn.pid, _process_name(conn.pid)
        return None


# Runs under engine.python: torch's version and CUDA runtime from torch/version.py (the file torch's
# build writes: `__version__`, `cuda`), read without importing torch (seconds, and on a host without
# a GPU its CUDA initialisation is not wanted).
TORCH_BUILD_SCRIPT = r"""
import importlib.util, json, os
spec = importlib.util.find_spec("torch")
out = {"found": False}
if spec is not None and spec.submodule_search_locations:
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    names = {}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), names)
    out = {"found": True, "version": str(names.get("__version__") or ""), "cuda": names.get("cuda")}
print(json.dumps(out))
"""


def torch_build(python: str, timeout: float = 30):
    """The engine environment's torch build (`molctl.cudacompat.TorchBuild`), None when `python`
    has no torch. Raises OSError (no such interpreter, it failed) or subprocess.TimeoutExpired."""
    import json
    import subprocess

    from molctl.cudacompat import TorchBuild

    proc = subprocess.run(
        [python, "-c", TORCH_BUILD_SCRIPT], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise OSError(f"{python} failed (exit {proc.returncode}): {tail}")
    data = json.loads(lines[-1])
    if not data.get("found"):
        return None
    cuda = data.get("cuda")
    return TorchBuild(str(data.get("version") or "?"), cuda if isinstance(cuda, str) and cuda else None)
