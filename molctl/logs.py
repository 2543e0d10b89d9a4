"""`molctl logs`: the newest log file of each component, prefixed, optionally followed across
restarts (a restart opens a new timestamped log; following switches to it) and rotations.

Bounded: `up` keeps the `logs.keep` newest files per component, and the proxy rotates its own
log at `logs.max_bytes` (`rotate_stdio`, keeping `logs.backups` parts as `.log.1`, `.log.2`)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from molctl.errors import UsageError
from molctl.output import Output
from molctl.processes import tail
from molctl.state import COMPONENTS, component_logs, is_same_process, newest_log, read_records


def deleted_log(record) -> Path | None:
    """For a live component (check `is_same_process` first) whose log file, the record's `log`,
    was deleted while it runs (an operator freeing disk space): its stdout, which it writes on to,
    as /proc/PID/fd/1 (readable by the same user; the disk space is freed only when it stops);
    None otherwise."""
    fd = Path(f"/proc/{record.pid}/fd/1")
    try:
        target = os.readlink(fd)
    except OSError:
        return None
    return fd if target == f"{record.log} (deleted)" else None


def _pick_profile(state_dir: Path, profile: str | None) -> str:
    """The named profile; else the running stack; else the profile with the newest log."""
    if profile:
        return profile
    from molctl.stacks import running_profiles

    try:
        names = sorted(d.name for d in state_dir.iterdir() if (d / "logs").is_dir()) if state_dir.is_dir() else []
    except OSError as exc:
        raise UsageError(f"cannot read {state_dir}: {exc.strerror or exc}") from None
    if not names:
        raise UsageError(f"no stack logs in {state_dir} (start one with molctl up PROFILE)")
    running = [n for n in running_profiles(state_dir) if n in names]
    if running:
        return running[0]

    def newest(name: str) -> float:
        logs = [p for c in COMPONENTS for p in component_logs(state_dir, name, c)]
        return max((p.stat().st_mtime for p in logs), default=0.0)

    return max(names, key=newest)


FOLLOW_READ_MAX = 1 << 20  # bytes `logs -f` reads per component and poll (a log that grew by gigabytes)
FOLLOW_LINE_MAX = 64 << 10  # bytes of a line without end that `logs -f` holds before showing it


def show_logs(ctx, profile: str | None, component: str | None, follow: bool, lines: int,
              out: Output | None = None, poll_s: float = 0.2, stop_after_s: float | None = None) -> None:
    out = out or Output()
    if component is not None and component not in COMPONENTS:
        raise UsageError(f"--component {component!r}: expected engine or proxy")
    if lines < 0:
        raise UsageError(f"--lines {lines}: expected 0 or more")
    if profile:
        from molctl.stacks import known_or_recorded

        known_or_recorded(ctx, profile)  # a typo is exit 3 listing the known profiles
    name = _pick_profile(ctx.state_dir, profile)
    components = [component] if component else list(COMPONENTS)
    unlinked: dict[str, Path] = {}  # component -> its open stdout, where its log file was deleted
    records = read_records(ctx.state_dir, name)
    for comp in components:
        record = records.get(comp)
        if record is not None and is_same_process(record) and (fd := deleted_log(record)) is not None:
            unlinked[comp] = fd
            out.raw(f"[{comp}] ==> {record.log} was deleted while pid {record.pid} runs: read from its open file "
                    f"{fd} (the disk space is freed when it stops) <==\n")
    current: dict[str, tuple[Path, int, int]] = {}  # path, position, inode
    for comp in components:
        path = unlinked.get(comp) or newest_log(ctx.state_dir, name, comp)
        if path is None:
            continue
        for line in tail(path, lines):
            out.raw(f"[{comp}] {line}\n")
        st = path.stat()
        current[comp] = (path, st.st_size, st.st_ino)
    if not current and not follow:
        raise UsageError(f"no {component or 'engine or proxy'} log for profile {name} in {ctx.state_dir / name / 'logs'}")
    if not follow:
        return
    started = time.monotonic()
    partial: dict[str, bytes] = {}  # a line not ended yet, per component (bytes: a UTF-8 character may be split)
    while stop_after_s is None or time.monotonic() - started < stop_after_s:
        for comp in components:
            newest = unlinked.get(comp) or newest_log(ctx.state_dir, name, comp)
            if newest is None:
                continue
            path, pos, ino = current.get(comp, (None, 0, None))
            try:
                st = newest.stat()
            except OSError:
                continue
            if newest != path:
                if path is not None:
                    out.raw(f"[{comp}] ==> new log {newest} <==\n")
                path, pos, ino = newest, 0, st.st_ino
                partial[comp] = b""
            elif st.st_ino != ino or st.st_size < pos:  # rotated (a new file under the same name)
                out.raw(f"[{comp}] ==> {newest} was rotated <==\n")
                pos, ino = 0, st.st_ino
                partial[comp] = b""
            try:
                with open(path, "rb") as fh:
                    fh.seek(pos)
                    data = fh.read(FOLLOW_READ_MAX)
            except OSError:
                continue
            if data:
                *complete, rest = (partial.get(comp, b"") + data).split(b"\n")
                for line in complete:
                    out.raw(f"[{comp}] {line.decode(errors='replace')}\n")
                if len(rest) > FOLLOW_LINE_MAX:  # a line without end (a dumped tensor): shown in pieces, not held
                    out.raw(f"[{comp}] {rest.decode(errors='replace')}\n")
                    rest = b""
                partial[comp] = rest
            current[comp] = (path, pos + len(data), ino)
        time.sleep(poll_s)


def rotate_now(path: Path, backups: int) -> None:
    """`path` -> `path.1` -> `path.2` ... (at most `backups` parts; 0 = truncate in place)."""
    if backups <= 0:
        return
    for i in range(backups, 0, -1):
        src = Path(f"{path}.{i - 1}") if i > 1 else path
        if src.exists():
            os.replace(src, Path(f"{path}.{i}"))


def rotate_stdio(max_bytes: int, backups: int, check_every_s: float = 1.0) -> threading.Thread | None:
    """Size-based rotation of the log file this process's stdout/stderr write to (the proxy's
    own log, opened by `up`): when it exceeds `max_bytes`, it is renamed to `.1` (older parts
    shifted, at most `backups` kept) and a new file is opened under the same name on fds 1 and 2.
    Everything the process writes is covered, tracebacks included. No-op when stdout is not a
    regular file."""
    import stat

    try:
        st = os.fstat(1)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    path = Path(os.readlink("/proc/self/fd/1")) if os.path.exists("/proc/self/fd/1") else None
    if path is None or not path.is_absolute():
        return None

    def loop() -> None:
        while True:
            time.sleep(check_every_s)
            try:
                if os.fstat(1).st_size < max_bytes:
                    continue
                import sys

                sys.stdout.flush()
                sys.stderr.flush()
                if backups > 0:
                    rotate_now(path, backups)
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    os.close(fd)
                else:
                    os.ftruncate(1, 0)
            except OSError:
                continue

    thread = threading.Thread(target=loop, name="log-rotation", daemon=True)
    thread.start()
    return thread
