"""Spawning and stopping stack components as process groups, without ever signalling a stranger.

Each component runs in its own session (so its own process group, pgid == leader pid) and
carries the marker of its record in its environment (see `molctl.procid`). The members of a
recorded component are:
  - its leader, when the pid still names the recorded process (same start ticks and boot), and
    every descendant of that leader;
  - every live process carrying the record's marker (`MOLCTL_RECORD_ID`), which finds vLLM's
    EngineCore and workers also when the API server itself was SIGKILLed and they were left
    behind, in the group or out of it.
A process that merely shares a recycled pid or process-group id has no marker and is never
touched. Stopping means SIGTERM then SIGCONT (to the group when its leader is verified ours,
else to each member), waiting up to a deadline, SIGKILL, then verifying that no member survived.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from molctl import procid
from molctl.state import Record, is_same_process


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    cwd: str | None = None,
    marker: Mapping[str, str] | None = None,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen:
    """Start a component in its own session: stdin closed, umask 077, output appended to its log,
    the record's marker in its environment and as its working directory (`procid.run_dir`),
    `pass_fds` (host-wide lock files) inherited. A relative program path is resolved first, as
    the working directory changes."""
    log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    env = {k: v for k, v in env.items() if k not in (procid.MARKER_ID, procid.MARKER_PATH)}
    env.update(marker or {})
    argv = list(argv)
    if marker and cwd is None:
        run = procid.run_dir(marker[procid.MARKER_PATH], marker[procid.MARKER_ID])
        run.mkdir(mode=0o700, parents=True, exist_ok=True)
        cwd = str(run)
        if os.sep in argv[0] and not os.path.isabs(argv[0]):
            argv[0] = os.path.abspath(argv[0])
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            umask=0o077,
            cwd=cwd,
            close_fds=True,
            pass_fds=tuple(pass_fds),
        )
    finally:
        os.close(fd)


def new_marker(record_file: Path) -> dict[str, str]:
    import uuid

    return {procid.MARKER_ID: uuid.uuid4().hex, procid.MARKER_PATH: os.path.realpath(record_file)}


def record_for(
    component: str,
    proc: subprocess.Popen,
    argv: Sequence[str],
    port: int,
    log_path: Path,
    marker: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
    config: dict | None = None,
) -> Record:
    ident = procid.identity(proc.pid)
    return Record(
        component=component,
        pid=proc.pid,
        pgid=proc.pid,
        create_time=ident.create_time or time.time(),
        argv=list(argv),
        port=port,
        log=str(log_path),
        started_at=time.time(),
        start_ticks=ident.start_ticks,
        boot_id=ident.boot_id,
        record_id=(marker or {}).get(procid.MARKER_ID, ""),
        host=host,
        config=dict(config or {}),
    )


def kill_fresh(proc: subprocess.Popen, gone_within_s: float = 2.0) -> None:
    """SIGKILL the group of a process this molctl spawned in a session of its own (start_new_session:
    its pgid is its pid; only called before it is reaped, so the id is still ours) and reap it;
    then wait, at most `gone_within_s`, until no live member of the group is left (a SIGKILL is
    delivered asynchronously: a wrapper's child could still be running when the leader was reaped)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + gone_within_s
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)


def _group_alive(pgid: int) -> bool:
    """A member of process group `pgid` is alive (zombies waiting for their reaper do not count)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return any(_pgid(p) == pgid and is_alive(p) for p in psutil.process_iter())


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
    if record.record_id:
        for pid, _path, rid in procid.marked_processes():
            if rid == record.record_id and pid not in found:
                try:
                    found[pid] = psutil.Process(pid)
                except psutil.NoSuchProcess:
                    continue
    return [p for p in found.values() if is_alive(p)]


def marked_by_path(prefix: Path) -> list[tuple[psutil.Process, str]]:
    """Live processes whose marker names a record file under `prefix` (a state dir, or a
    profile's folder in it): found without reading any record (corrupt or unreadable ones)."""
    prefix_s = os.path.realpath(prefix).rstrip("/") + "/"
    out = []
    for pid, path, _rid in procid.marked_processes():
        if path.startswith(prefix_s):
            try:
                proc = psutil.Process(pid)
            except psutil.NoSuchProcess:
                continue
            if is_alive(proc):
                out.append((proc, path))
    return out


def stack_pids(state_dir: Path, profile: str) -> set[int]:
    """Pids of every live process of this profile's recorded components."""
    from molctl.state import read_records

    return {p.pid for record in read_records(state_dir, profile).values() for p in members(record)}


def is_alive(proc: psutil.Process) -> bool:
    """Running and not a zombie; a zombie leader whose other threads still run is alive (it still
    holds its files, claims and GPU memory: `procid.threads_running`)."""
    try:
        return proc.is_running() and (proc.status() != psutil.STATUS_ZOMBIE or procid.threads_running(proc.pid))
    except psutil.NoSuchProcess:
        return False


def _signal_all(record: Record | None, procs: list[psutil.Process], sig: int) -> None:
    """To the whole group when its leader is verified ours (catches processes forked meanwhile),
    and to every member outside it; otherwise to each member (each verified) only."""
    group = record.pgid if record is not None and is_same_process(record) else None
    if group is not None:
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        if group is not None and _pgid(p) == group:
            continue
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


def stop(
    record: Record,
    timeout_s: float,
    sleep: Callable[[float], None] = time.sleep,
    on_escalate: Callable[[], None] | None = None,
    on_wait: Callable[[float], None] | None = None,
    wait_every_s: float = 10.0,
) -> StopResult:
    """SIGTERM (then SIGCONT: a stopped process acts on it) the component, wait up to
    `timeout_s`, SIGKILL what is left, verify.
    `on_wait(seconds_left)` is called every `wait_every_s` while it waits (a countdown)."""
    return stop_processes(
        record, members(record), timeout_s, sleep, on_escalate, on_wait, wait_every_s, lambda: members(record)
    )


def stop_processes(
    record: Record | None,
    procs: list[psutil.Process],
    timeout_s: float,
    sleep: Callable[[float], None] = time.sleep,
    on_escalate: Callable[[], None] | None = None,
    on_wait: Callable[[float], None] | None = None,
    wait_every_s: float = 10.0,
    rescan: Callable[[], list[psutil.Process]] | None = None,
) -> StopResult:
    found = len(procs)
    if not procs:
        return StopResult(0, False, [])
    _signal_all(record, procs, signal.SIGTERM)
    # A stopped process (SIGSTOP, Ctrl-Z, a debugger) keeps SIGTERM pending until it is
    # continued: without SIGCONT it would sit out the whole deadline, then be SIGKILLed with no
    # drain or shutdown. systemd sends SIGCONT after SIGTERM for the same reason.
    _signal_all(record, procs, signal.SIGCONT)
    start = time.monotonic()
    deadline = start + timeout_s
    next_report = start + wait_every_s
    while time.monotonic() < deadline:
        procs = [p for p in procs if is_alive(p)]
        if not procs:
            break
        now = time.monotonic()
        if on_wait is not None and now >= next_report:
            on_wait(max(0.0, deadline - now))
            next_report += wait_every_s
        sleep(0.1)
    procs = [p for p in (rescan() if rescan else procs) if is_alive(p)] or [p for p in procs if is_alive(p)]
    killed = bool(procs)
    if procs:
        if on_escalate:
            on_escalate()
        _signal_all(record, procs, signal.SIGKILL)
        end = time.monotonic() + 5
        while time.monotonic() < end and any(is_alive(p) for p in procs):
            sleep(0.05)
    left = rescan() if rescan else [p for p in procs if is_alive(p)]
    survivors = [f"{p.pid} {_name(p)}" for p in left if is_alive(p)]
    return StopResult(found, killed, survivors)


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.NoSuchProcess:
        return "?"


TAIL_BLOCK = 1 << 20  # bytes read per step when scanning a log backwards for its last lines
TAIL_LINE_MAX = 4096  # bytes of one log line `tail` keeps (its end): a dumped tensor or JSON can make a huge one


def tail_start(fh, end: int, lines: int) -> int:
    """Where the last `lines` lines of the file's first `end` bytes start (a final line without
    newline counts), scanning backwards block by block: linear, whatever `lines` is. At most
    `lines` * TAIL_LINE_MAX bytes back (the start may then fall inside a line)."""
    if lines <= 0 or end <= 0:
        return end
    floor = max(0, end - lines * TAIL_LINE_MAX)
    fh.seek(end - 1)
    pos = end - 1 if fh.read(1) == b"\n" else end  # the newline ending the last line starts nothing
    need = lines
    while pos > floor:
        step = min(TAIL_BLOCK, pos - floor)
        pos -= step
        fh.seek(pos)
        chunk = fh.read(step)
        found = chunk.count(b"\n")
        if found >= need:
            i = len(chunk)
            for _ in range(need):
                i = chunk.rindex(b"\n", 0, i)
            return pos + i + 1
        need -= found
    return floor


def tail(path: Path | str, lines: int = 80) -> list[str]:
    """The last `lines` lines of a (possibly large) log file (none for lines <= 0); at most
    `lines` * TAIL_LINE_MAX bytes are read, and a longer line keeps only its end."""
    if lines <= 0:
        return []
    try:
        with open(path, "rb") as fh:
            end = fh.seek(0, os.SEEK_END)
            start = tail_start(fh, end, lines)
            mid_line = start > 0 and fh.seek(start - 1) >= 0 and fh.read(1) != b"\n"  # the byte bound cut a line
            fh.seek(start)
            data = fh.read(end - start)
    except OSError:
        return []
    out = [
        line if len(line) <= TAIL_LINE_MAX else "..." + line[-TAIL_LINE_MAX:]
        for line in data.decode(errors="replace").splitlines()[-lines:]
    ]
    if mid_line and out and not out[0].startswith("..."):
        out[0] = "..." + out[0]
    return out
