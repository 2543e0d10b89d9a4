"""Process identity that survives wall-clock steps and pid reuse, and the marker our spawns carry.

A process is named by its pid *and* its start time in clock ticks since boot (field 22 of
`/proc/PID/stat`), with the boot id: neither moves when the wall clock is stepped (NTP step, VM
migration), unlike psutil's `create_time()` (boot time + ticks, re-derived from the wall clock).
Where `/proc` is missing (macOS), psutil's create time is the fallback.

Every component molctl spawns carries a marker in its environment, inherited by its children
(vLLM's EngineCore and workers): `MOLCTL_RECORD` (the record file's path) and `MOLCTL_RECORD_ID`
(a random id stored in the record). Only our spawn sets them, so a process carrying them is ours
even after its leader died; a process without them that merely shares a recycled pid or process
group id is a stranger and is never signalled.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

MARKER_ID = "MOLCTL_RECORD_ID"
MARKER_PATH = "MOLCTL_RECORD"
PROC = Path("/proc")


def have_proc() -> bool:
    return sys.platform.startswith("linux") and (PROC / "self" / "stat").exists()


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (the command name, which may hold spaces, is cut off)."""
    try:
        raw = (PROC / str(pid) / "stat").read_bytes().decode(errors="replace")
    except (OSError, ValueError):
        return None
    return raw[raw.rfind(")") + 2:].split()


def start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None when it does not exist (or is a zombie)."""
    fields = _stat_fields(pid)
    if not fields or fields[0] == "Z":
        return None
    try:
        return int(fields[19])  # field 22
    except (IndexError, ValueError):
        return None


_BOOT_ID: str | None = None


def boot_id() -> str | None:
    global _BOOT_ID
    if _BOOT_ID is None:
        try:
            _BOOT_ID = (PROC / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
        except OSError:
            return None
    return _BOOT_ID


@dataclass(frozen=True)
class Identity:
    start_ticks: int | None
    boot_id: str | None
    create_time: float | None


def identity(pid: int) -> Identity:
    import psutil

    try:
        create = psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        create = None
    if have_proc():
        return Identity(start_ticks(pid), boot_id(), create)
    return Identity(None, None, create)


def environ_of(pid: int) -> dict[str, str] | None:
    """The environment `pid` was started with (None when it cannot be read: gone, another user's)."""
    if have_proc():
        try:
            raw = (PROC / str(pid) / "environ").read_bytes()
        except OSError:
            return None
        out = {}
        for item in raw.split(b"\0"):
            key, sep, value = item.partition(b"=")
            if sep:
                out[key.decode(errors="replace")] = value.decode(errors="replace")
        return out
    import psutil

    try:
        return psutil.Process(pid).environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return None


def all_pids() -> list[int]:
    if have_proc():
        return [int(n) for n in os.listdir(PROC) if n.isdigit()]
    import psutil

    return psutil.pids()


def marked_processes() -> list[tuple[int, str, str]]:
    """(pid, record path, record id) of every live process carrying a molctl marker that this
    user can read. Zombies are left out."""
    me = os.getpid()
    out = []
    for pid in all_pids():
        if pid == me:
            continue
        if have_proc():
            try:
                raw = (PROC / str(pid) / "environ").read_bytes()
            except OSError:
                continue
            if MARKER_ID.encode() not in raw:
                continue
        env = environ_of(pid)
        if not env or MARKER_ID not in env:
            continue
        if have_proc() and start_ticks(pid) is None:  # zombie or gone
            continue
        out.append((pid, env.get(MARKER_PATH, ""), env[MARKER_ID]))
    return out
