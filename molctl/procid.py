"""Process identity that survives wall-clock steps and pid reuse, and the marker our spawns carry.

A process is named by its pid *and* its start time in clock ticks since boot (field 22 of
`/proc/PID/stat`), with the boot id: neither moves when the wall clock is stepped (NTP step, VM
migration), unlike psutil's `create_time()` (boot time + ticks, re-derived from the wall clock).
Where `/proc` is missing (macOS), psutil's create time is the fallback.

Every component molctl spawns carries a marker, inherited by its children (vLLM's EngineCore and
workers), in two places:
  - its environment: `MOLCTL_RECORD` (the record file's path) and `MOLCTL_RECORD_ID` (a random id
    stored in the record);
  - its working directory: `STATE/PROFILE/COMPONENT.run/RECORD_ID/`, made for that spawn alone.
The second exists because a process that renames itself with `setproctitle` (vLLM's
`VLLM::EngineCore` and `VLLM::Worker` do) overwrites the memory `/proc/PID/environ` is read from,
so its environment marker is gone; its working directory is not touched (vLLM never `chdir`s, and
multiprocessing's spawn children start in their parent's directory).
The working directory counts only for a process whose environment shows no variable at all (the
wiped one): a process that shows an environment without the marker (a shell an operator `cd`'d
into the run dir) is not ours. Only our spawn sets either,
so a process carrying one is ours even after its leader died; a process without them that merely
shares a recycled pid or process group id is a stranger and is never signalled.
"""

from __future__ import annotations

import os
import re
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
    return raw[raw.rfind(")") + 2 :].split()


def threads_running(pid: int) -> bool:
    """Whether a thread of `pid` is neither a zombie nor dead. A process whose main thread exited
    first shows a zombie leader while its other threads run on (one blocked in a write, say); it
    keeps its files, file locks and GPU contexts until its last thread exits."""
    task = PROC / str(pid) / "task"
    try:
        tids = os.listdir(task)
    except OSError:
        return False
    for tid in tids:
        try:
            raw = (task / tid / "stat").read_bytes().decode(errors="replace")
        except OSError:
            continue
        state = raw[raw.rfind(")") + 2 :][:1]
        if state and state not in "ZXx":
            return True
    return False


def start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None when it does not exist (or is a
    zombie with no thread still running)."""
    fields = _stat_fields(pid)
    if not fields or (fields[0] == "Z" and not threads_running(pid)):
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


RUN_SUFFIX = ".run"
_RECORD_ID = re.compile(r"[0-9a-f]{32}")


def run_dir(record_file: Path | str, record_id: str) -> Path:
    """The working directory a spawn with this record id runs in (its second marker)."""
    record_file = Path(record_file)
    return record_file.parent / (record_file.stem + RUN_SUFFIX) / record_id


def marker_of_cwd(cwd: str) -> tuple[str, str] | None:
    """(record path, record id) when `cwd` is a spawn's run dir (also once it was deleted)."""
    if cwd.endswith(" (deleted)"):
        cwd = cwd[: -len(" (deleted)")]
    run = Path(cwd)
    if not _RECORD_ID.fullmatch(run.name) or not run.parent.name.endswith(RUN_SUFFIX):
        return None
    component = run.parent.name[: -len(RUN_SUFFIX)]
    return str(run.parent.parent / f"{component}.json"), run.name


def _cwd_of(pid: int) -> str | None:
    if have_proc():
        try:
            return os.readlink(PROC / str(pid) / "cwd")
        except OSError:
            return None
    import psutil

    try:
        return psutil.Process(pid).cwd()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return None


def _env_marker(pid: int) -> tuple[str, str] | None:
    if have_proc():
        try:
            raw = (PROC / str(pid) / "environ").read_bytes()
        except OSError:
            return None
        if MARKER_ID.encode() not in raw:
            return None
    env = environ_of(pid)
    if not env or MARKER_ID not in env:
        return None
    return env.get(MARKER_PATH, ""), env[MARKER_ID]


def _in_components_group(pid: int, record_path: str, records: dict[str, tuple[int, int] | None]) -> bool:
    """Whether `pid` is in the process group or the session of the component recorded at
    `record_path` (components start in a session of their own; their children stay in it).
    vLLM's EngineCore and workers rename themselves (setproctitle), which overwrites what
    /proc/PID/environ shows only in part on some layouts: a few leftover entries, the marker gone.
    Their group and session still say whose they are, also after the leader was SIGKILLed."""
    if record_path not in records:
        try:
            import json

            with open(record_path, "rb") as fh:
                data = json.loads(fh.read(1 << 20))
            records[record_path] = (int(data["pid"]), int(data["pgid"]))
        except (OSError, ValueError, KeyError, TypeError):
            records[record_path] = None
    ids = records[record_path]
    if ids is None:
        return False
    try:
        return os.getpgid(pid) == ids[1] or os.getsid(pid) == ids[0]
    except OSError:
        return False


def marked_processes() -> list[tuple[int, str, str]]:
    """(pid, record path, record id) of every live process carrying a molctl marker (environment
    or working directory) that this user can read. Zombies are left out."""
    me = os.getpid()
    out = []
    records: dict[str, tuple[int, int] | None] = {}  # record path -> its (pid, pgid), read once
    for pid in all_pids():
        if pid == me:
            continue
        found = _env_marker(pid)
        if found is None:
            cwd = _cwd_of(pid)
            found = marker_of_cwd(cwd) if cwd else None
            if found is not None and environ_of(pid) and not _in_components_group(pid, found[0], records):
                # an environment without our marker, in another process group and session than the
                # recorded component: not a spawn of ours (an operator's shell in the run dir)
                continue
        if found is None:
            continue
        if have_proc() and start_ticks(pid) is None:  # zombie or gone
            continue
        if not _started_by_us(pid):
            # anyone can put a marker in the environment of a process of theirs (a setuid program
            # included): root's `down` and `up` killed it, `status` called the stack degraded
            continue
        out.append((pid, *found))
    return out


def _started_by_us(pid: int) -> bool:
    """Whether `pid`'s real uid is ours, as it is for everything we spawn and its children (a
    setuid program another user started keeps that user's real uid)."""
    if have_proc():
        try:
            with open(PROC / str(pid) / "status", "rb") as fh:
                for line in fh:
                    if line.startswith(b"Uid:"):
                        return int(line.split()[1]) == os.getuid()
        except (OSError, ValueError, IndexError):
            return False
        return False
    import psutil

    try:
        return psutil.Process(pid).uids().real == os.getuid()
    except (psutil.Error, OSError):
        return False
