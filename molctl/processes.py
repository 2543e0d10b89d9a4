"""Spawning and stopping stack components as process groups, without ever signalling a stranger.

Each component runs in its own session (so its own process group, pgid == leader pid). Stopping
means SIGTERM to the group, waiting up to a deadline, SIGKILL to the group, then verifying that
no member survived. Members are the processes in the recorded group *created after the leader*
(a pid or pgid reused by an unrelated, older process is never touched), plus the leader's
descendants that moved to another group; vLLM's EngineCore and worker processes are found
either way, also when the API server itself was SIGKILLed and they were left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import psutil

from molctl.state import Record, is_same_process

TOLERANCE_S = 0.05  # create_time resolution


def spawn(argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: str | None = None) -> subprocess.Popen:
    """Start a component in its own session: stdin closed, umask 077, output appended to its log."""
    log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT,
                                start_new_session=True, umask=0o077, cwd=cwd, close_fds=True)
    finally:
        os.close(fd)


def record_for(component: str, proc: subprocess.Popen, argv: Sequence[str], port: int, log_path: Path) -> Record:
    p = psutil.Process(proc.pid)
    return Record(component=component, pid=proc.pid, pgid=os.getpgid(proc.pid), create_time=p.create_time(),
                  argv=list(argv), port=port, log=str(log_path), started_at=time.time())


def members(record: Record) -> list[psutil.Process]:
    """Live processes belonging to the recorded component (see the module docstring)."""
    found: dict[int, psutil.Process] = {}
    if is_same_process(record):
        try:
            leader = psutil.Process(record.pid)
            found[leader.pid] = leader
            for child in leader.children(recursive=True):
                found[child.pid] = child
        except psutil.NoSuchProcess:
            pass
    elif _running(record.pgid):
        # The kernel does not hand out a pid that is still a process-group id. So if pid == pgid
        # exists but is not our leader, the group is someone else's: never touch it.
        return []
    for proc in psutil.process_iter(["pid", "create_time"]):
        try:
            if proc.pid in found or proc.info["create_time"] is None:
                continue
            if os.getpgid(proc.pid) == record.pgid and proc.info["create_time"] >= record.create_time - TOLERANCE_S:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found[proc.pid] = proc
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied, PermissionError):
            continue
    return [p for p in found.values() if _alive(p)]


def stack_pids(state_dir: Path, profile: str) -> set[int]:
    """Pids of every live process of this profile's recorded components."""
    from molctl.state import read_records

    return {p.pid for record in read_records(state_dir, profile).values() for p in members(record)}


def _running(pid: int) -> bool:
    """A live, non-zombie process with this pid exists."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal_all(record: Record, procs: list[psutil.Process], sig: int) -> None:
    group_alive = any(_pgid(p) == record.pgid for p in procs)
    if group_alive:
        try:
            os.killpg(record.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:  # members that left the group
        if _pgid(p) != record.pgid:
            try:
                p.send_signal(sig)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass


def _pgid(proc: psutil.Process) -> int | None:
    try:
        return os.getpgid(proc.pid)
    except (ProcessLookupError, PermissionError):
        return None


@dataclass
class StopResult:
    signalled: int  # processes found at the start
    killed: bool  # SIGKILL was needed
    survivors: list[str]  # "pid name" of processes still alive at the end

    @property
    def ok(self) -> bool:
        return not self.survivors


def stop(record: Record, timeout_s: float, sleep: Callable[[float], None] = time.sleep,
         on_escalate: Callable[[], None] | None = None) -> StopResult:
    """SIGTERM the component's group, wait up to `timeout_s`, SIGKILL what is left, verify."""
    procs = members(record)
    found = len(procs)
    if not procs:
        return StopResult(0, False, [])
    _signal_all(record, procs, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs = [p for p in procs if _alive(p)]
        if not procs:
            break
        sleep(0.1)
    procs = [p for p in members(record) if _alive(p)] or [p for p in procs if _alive(p)]
    killed = bool(procs)
    if procs:
        if on_escalate:
            on_escalate()
        _signal_all(record, procs, signal.SIGKILL)
        end = time.monotonic() + 5
        while time.monotonic() < end and any(_alive(p) for p in procs):
            sleep(0.05)
    survivors = [f"{p.pid} {_name(p)}" for p in members(record)]
    return StopResult(found, killed, survivors)


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.NoSuchProcess:
        return "?"


def tail(path: Path | str, lines: int = 80) -> list[str]:
    """The last `lines` lines of a (possibly large) log file."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            block, data = 8192, b""
            while size > 0 and data.count(b"\n") <= lines:
                step = min(block, size)
                size -= step
                fh.seek(size)
                data = fh.read(step) + data
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-lines:]
