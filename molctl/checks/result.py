"""What a check is and what a run of checks gives: `CheckResult` (one row), `Probes` (everything
the checks learn about the host, injected so tests pass fakes), `Report` (a profile's rows) and
`describe` (a one-line list for details). The category modules and `molctl.checks` import them."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from molctl.probes import GpuProbe, NvmlProbe, PortProbe, torch_build

Status = Literal["pass", "warn", "fail", "skip"]


@dataclass(frozen=True)
class CheckResult:
    id: str
    status: Status
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"id": self.id, "status": self.status, "detail": self.detail}


@dataclass
class Probes:
    """Everything the checks learn about the host comes through here (tests inject fakes)."""

    gpu: GpuProbe = field(default_factory=NvmlProbe)
    ports: PortProbe = field(default_factory=PortProbe)
    state_dir: Path | None = None
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    api_key_file: Path | None = None
    stack_pids: Callable[[], set[int]] = field(default_factory=lambda: set)
    own_profiles: frozenset[str] = frozenset()  # stacks of state_dir whose host-wide claims are not foreign
    verify: Any = None  # a molctl.checks.verify.Verify: add the `lock` category (check/up --verify)
    # engine.python -> its torch build (molctl.cudacompat.TorchBuild; None: no torch): the CUDA runtime gpu.driver compares
    torch_build: Callable[[str], Any] = field(default_factory=lambda: torch_build)
    mounts: Callable[[], str] = field(default_factory=lambda: _proc_mounts)  # /proc/mounts (model.load-strategy)
    available_memory: Callable[[], int] = field(default_factory=lambda: _available_memory)


@dataclass
class Report:
    profile: str
    checks: list[CheckResult]

    @property
    def ok(self) -> bool:
        return not any(c.status == "fail" for c in self.checks)

    def as_dict(self) -> dict:
        return {"profile": self.profile, "ok": self.ok, "checks": [c.as_dict() for c in self.checks]}

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in ("pass", "warn", "fail", "skip")}
        for c in self.checks:
            out[c.status] += 1
        return out


def describe(paths: list[str], limit: int = 3) -> str:
    """'a, b, c and 4 more' for details that must stay one line."""
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _proc_mounts() -> str:
    try:
        return Path("/proc/mounts").read_text()
    except OSError:
        return ""


def _available_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().available)
