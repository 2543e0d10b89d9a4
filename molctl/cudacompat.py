"""The NVIDIA driver a CUDA runtime needs, and the verdict on a host's driver for the engine's runtime.

The engine's wheels carry their own CUDA runtime (torch 2.11.0+cu130 links `libcudart.so.13`); the
one host part is the driver, which must be new enough for that runtime's major version, else the
runtime refuses to start (cudaErrorInsufficientDriver) after molctl has launched the engine.

Sources (Linux x86_64):
- NVIDIA, "CUDA Compatibility", section "Minor Version Compatibility", Table 1 "CUDA Toolkit 11.x,
  12.x, and 13.x Minimum and Maximum Required Driver Versions"
  (https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html): CUDA 13.x
  needs >= 580, 12.x >= 525, 11.x >= 450; any newer driver runs an older runtime (binary backward
  compatibility). The exact minimums are the CUDA Toolkit Release Notes' Table 2 ("CUDA Toolkit and
  Minimum Required Driver Version for CUDA Minor Version Compatibility"): 12.x >= 525.60.13, 11.x
  >= 450.80.02.
- CUDA Toolkit Release Notes, Table 3 "CUDA Toolkit and Corresponding Driver Versions" (the GA
  releases): the driver each minor release ships with. A driver of the right major branch but
  older than that runs the runtime through minor version compatibility, with a limited feature
  set (PTX JIT of newer code fails, cudaErrorUnsupportedPtxVersion): a warning, not a failure.
"""

from __future__ import annotations

from dataclasses import dataclass

# CUDA major -> the least driver its runtime starts on (minor version compatibility)
MAJOR_MINIMUM: dict[int, tuple[int, ...]] = {
    13: (580,),
    12: (525, 60, 13),
    11: (450, 80, 2),
}

# CUDA major.minor -> the driver that release ships with (its full feature set)
MINOR_DRIVER: dict[tuple[int, int], tuple[int, ...]] = {
    (12, 0): (525, 60, 13),
    (12, 1): (530, 30, 2),
    (12, 2): (535, 54, 3),
    (12, 3): (545, 23, 6),
    (12, 4): (550, 54, 14),
    (12, 5): (555, 42, 2),
    (12, 6): (560, 28, 3),
    (12, 8): (570, 26),
    (12, 9): (575, 51, 3),
    (13, 0): (580, 65, 6),
}


@dataclass(frozen=True)
class TorchBuild:
    """What the engine environment's torch was built with: its version and CUDA runtime (None: a CPU build)."""

    version: str
    cuda: str | None


def _numbers(text: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in text.strip().split("."))
    except ValueError:
        return None


def _dotted(numbers: tuple[int, ...]) -> str:
    return ".".join(f"{n:02d}" if i else str(n) for i, n in enumerate(numbers))


def driver_verdict(driver: str, cuda: str) -> tuple[str, str]:
    """("pass" | "warn" | "fail", why) for NVIDIA driver `driver` running CUDA runtime `cuda`."""
    have, want = _numbers(driver), _numbers(cuda)
    if have is None or want is None or len(want) < 2:
        return "warn", f"cannot compare driver {driver!r} with CUDA {cuda!r}: not versions"
    major, minor = want[0], want[1]
    minimum = MAJOR_MINIMUM.get(major)
    if minimum is None:
        return "warn", f"CUDA {cuda}: no known minimum driver for CUDA {major}.x; not compared"
    if have < minimum:
        return "fail", (
            f"NVIDIA driver {driver} is older than CUDA {cuda} needs (>= {_dotted(minimum)} for CUDA {major}.x): "
            f"the engine's CUDA runtime will not start; install driver {minimum[0]} or later"
        )
    shipped = MINOR_DRIVER.get((major, minor))
    if shipped is not None and have < shipped:
        return "warn", (
            f"NVIDIA driver {driver} is older than the {_dotted(shipped)} CUDA {major}.{minor} ships with: it runs "
            "through CUDA minor version compatibility (limited: PTX JIT of newer code fails)"
        )
    return "pass", f"NVIDIA driver {driver} runs CUDA {cuda} (needs >= {_dotted(minimum)})"
