"""A fake nvidia-ml-py (`import pynvml`) that fails where a test says, for the NVML error paths of
`check`, `status` and `down`. Put this folder first on the path (PYTHONPATH for a subprocess, or
`load()` for the tests' own interpreter) and choose with the environment:

- `FAKE_NVML=WHERE:KIND`: the call that fails. WHERE: init, driver, count, handle, name, memory,
  processes, shutdown. KIND: an NVML error code's name as nvidia-ml-py spells its class
  (DriverNotLoaded, GpuIsLost, LibraryNotFound, ...), `mismatch`, or `OSError` (not NVML's).
- `FAKE_NVML_DEVICES` (default 8), `FAKE_NVML_DRIVER` (default 580.95.05): what a healthy NVML reports;
  `FAKE_NVML_PIDS` (comma-separated): compute processes on GPU 0, 1 GiB each.

What it mimics, from nvidia-ml-py 13.615.71's pynvml.py:
- `NVMLError(Exception)` carries the return code in `value`; `NVMLError(code)` constructs the
  code's own subclass (`__new__` maps through `_valClassMapping`), made per NVML_ERROR_* constant
  by `_extractNVMLErrorsAsClasses` (NVML_ERROR_GPU_IS_LOST -> `NVMLError_GpuIsLost`); `str()` is
  the code's text from `_errcode_to_string` ("Driver Not Loaded", "GPU is lost").
- `class NVMLLibraryMismatchError(Exception)`: no NVMLError. `throwOnVersionMismatch` turns
  an `NVMLError_FunctionNotFound` of an unversioned call (`nvmlDeviceGetComputeRunningProcesses`,
  which picks the `_v3` symbol) into it: the driver's libnvidia-ml is older than the binding.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999


class NVMLLibraryMismatchError(Exception):
    pass


class NVMLError(Exception):
    _valClassMapping: dict = {}
    _errcode_to_string = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }

    def __new__(cls, value):
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self):
        return self._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")


def _classes() -> None:
    for name, value in list(globals().items()):
        if name.startswith("NVML_ERROR_"):
            cls_name = "NVMLError_" + "".join(w.capitalize() for w in name[len("NVML_ERROR_") :].split("_"))

            def new(cls, *args, _value=value):
                return NVMLError.__new__(cls, _value)

            cls = type(cls_name, (NVMLError,), {"__new__": new})
            globals()[cls_name] = cls
            NVMLError._valClassMapping[value] = cls


_classes()


def _fail(where: str) -> None:
    spec = os.environ.get("FAKE_NVML", "")
    at, _, kind = spec.partition(":")
    if at != where:
        return
    if kind == "mismatch":
        raise NVMLLibraryMismatchError(
            "Unversioned function called and the pyNVML version does not match the NVML lib version. "
            "Either use matching pyNVML and NVML lib versions or use a versioned function such as "
            "nvmlDeviceGetComputeRunningProcesses_v2"
        )
    if kind == "OSError":
        raise OSError(5, "Input/output error")
    raise globals()[f"NVMLError_{kind}"]()


def _devices() -> int:
    return int(os.environ.get("FAKE_NVML_DEVICES", "8"))


def nvmlInit():
    _fail("init")


def nvmlShutdown():
    _fail("shutdown")


def nvmlSystemGetDriverVersion():
    _fail("driver")
    return os.environ.get("FAKE_NVML_DRIVER", "580.95.05")


def nvmlDeviceGetCount():
    _fail("count")
    return _devices()


def nvmlDeviceGetHandleByIndex(index):
    _fail("handle")
    return index


def nvmlDeviceGetName(handle):
    _fail("name")
    return "NVIDIA H200"


def nvmlDeviceGetMemoryInfo(handle):
    _fail("memory")
    return SimpleNamespace(total=141 << 30, free=140 << 30, used=1 << 30)


def nvmlDeviceGetComputeRunningProcesses(handle):
    _fail("processes")
    pids = [int(p) for p in os.environ.get("FAKE_NVML_PIDS", "").split(",") if p] if handle == 0 else []
    return [SimpleNamespace(pid=pid, usedGpuMemory=1 << 30) for pid in pids]
