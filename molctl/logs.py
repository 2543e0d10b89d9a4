"""`molctl logs`: the newest log file of each component, prefixed, optionally followed across
restarts (a restart opens a new timestamped log; following switches to it) and rotations.

Bounded: `up` keeps the `logs.keep` newest files per component, and the proxy rotates its own
log at `logs.max_bytes` (`molctl.logfiles.rotate_stdio`, keeping `logs.backups` parts as `.log.1`, `.log.2`).
Control characters are escaped (`molctl.logfiles.escape_controls`) when a line is printed, and when the proxy
writes its log (`EscapingFormatter`): a log never drives the reader's terminal."""

from __future__ import annotations

import errno
import io
import os
import select
import stat
import time
from pathlib import Path

from molctl.errors import UsageError
from molctl.logfiles import escape_controls
from molctl.output import Output
from molctl.processes import TAIL_LINE_MAX, tail_start
from molctl.state import (
    COMPONENTS,
    check_readable,
    component_logs,
    deleted_log,
    is_same_process,
    newest_log,
    read_records,
)


def _pick_profile(state_dir: Path, profile: str | None) -> str:
    """The named profile; else the running stack; else the profile with the newest log."""
    if profile:
        return profile
    from molctl.lifecycle.stacks import running_profiles

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


def _keep_end(line: bytes) -> bytes:
    """A line as the tail shows it: its last TAIL_LINE_MAX bytes after one `...` when longer (as
    processes.tail). A line the byte bound already cut starts with that `...`; it is not counted
    in the length nor marked again."""
    text = line.removeprefix(b"...")
    return line if len(text) <= TAIL_LINE_MAX else b"..." + text[-TAIL_LINE_MAX:]


class _Log:
    """One component's log as `logs` reads it: an open file (still read after it is renamed or
    deleted), the position, and a line not ended yet (bytes: a UTF-8 character may be split)."""

    def __init__(self, comp: str, path: Path, out: Output, known: set[Path]):
        self.comp, self.out, self.known = comp, out, known
        self.fh = open(path, "rb")  # noqa: SIM115 - kept open while following; closed by close()
        self.path, self.pos, self.partial, self.deleted = path, 0, b"", False

    def close(self) -> None:
        self.fh.close()

    def say(self, text: str) -> None:
        self.out.raw(f"[{self.comp}] {text}\n")

    def tail(self, lines: int, follow: bool) -> None:
        """The last `lines` lines; then the position is the end (a last line without end is held
        when following, shown now otherwise)."""
        end = os.fstat(self.fh.fileno()).st_size
        start = tail_start(self.fh, end, lines)
        if start > 0 and lines > 0:
            self.fh.seek(start - 1)
            if self.fh.read(1) != b"\n":  # the byte bound cut a line: its start is left out
                self.partial = b"..."
        self.pos = start
        while self.pos < end:
            self.read(min(FOLLOW_READ_MAX, end - self.pos), long_lines="keep_end")
        if not follow:
            self.flush()

    def read(self, limit: int = FOLLOW_READ_MAX, long_lines: str = "pieces") -> int:
        """Show the complete lines of up to `limit` new bytes; how many were read. A line longer
        than the cap is shown in pieces (following) or by its end (`long_lines="keep_end"`, the tail)."""
        self.fh.seek(self.pos)
        data = self.fh.read(limit)
        self.pos += len(data)
        if data:
            *complete, rest = (self.partial + data).split(b"\n")
            for line in complete:
                self._show(line, keep_end=long_lines == "keep_end")
            cap = TAIL_LINE_MAX if long_lines == "keep_end" else FOLLOW_LINE_MAX
            if len(rest) > cap:
                if long_lines == "keep_end":
                    rest = _keep_end(rest)
                else:  # a line without end (a dumped tensor): shown in pieces, not held
                    self._show(rest)
                    rest = b""
            self.partial = rest
        return len(data)

    def _show(self, line: bytes, keep_end: bool = False) -> None:
        if keep_end:
            line = _keep_end(line)
        self.say(escape_controls(line.removesuffix(b"\r").decode(errors="replace")))

    def flush(self) -> None:
        """Show a line not ended yet (the file is left, or was all there is to show)."""
        if self.partial:
            self._show(self.partial)
            self.partial = b""

    def drain(self) -> None:
        while self.read() == FOLLOW_READ_MAX:
            pass

    def poll(self, newest: list[Path]) -> None:
        """New bytes; then a restart's new log (a name not seen before), a rotation (another file
        under the name) or a truncation (copytruncate) is followed, the old file read to its end
        first."""
        if self.read() == FOLLOW_READ_MAX:
            return  # more to read: the switches wait for the end
        new = [p for p in newest if p not in self.known]
        self.known.update(newest)
        if new:
            self.drain()
            self.flush()
            self.say(f"==> new log {new[-1]} <==")
            self.switch(new[-1])
            return
        try:
            st = os.stat(self.path)
        except OSError:
            if not self.deleted:
                self.deleted = True
                self.say(f"==> {self.path} was deleted: still reading the open file <==")
            return
        mine = os.fstat(self.fh.fileno())
        if (st.st_ino, st.st_dev) != (mine.st_ino, mine.st_dev):
            self.drain()
            self.flush()
            self.say(f"==> {self.path} was rotated <==")
            self.switch(self.path)
        elif mine.st_size < self.pos:
            self.partial = b""
            self.say(f"==> {self.path} was truncated <==")
            self.pos = 0

    def switch(self, path: Path) -> None:
        try:
            fh = open(path, "rb")  # noqa: SIM115 - see __init__
        except OSError:
            return
        self.fh.close()
        self.fh, self.path, self.pos, self.partial, self.deleted = fh, path, 0, b"", False


def show_logs(
    ctx,
    profile: str | None,
    component: str | None,
    follow: bool,
    lines: int,
    out: Output | None = None,
    poll_s: float = 0.2,
    stop_after_s: float | None = None,
) -> None:
    out = out or Output()
    if component is not None and component not in COMPONENTS:
        raise UsageError(f"--component {component!r}: expected engine or proxy")
    if lines < 0:
        raise UsageError(f"--lines {lines}: expected 0 or more")
    check_readable(ctx.state_dir)
    if profile:
        from molctl.lifecycle.stacks import known_or_recorded

        known_or_recorded(ctx, profile)  # a typo is exit 3 listing the known profiles
    name = _pick_profile(ctx.state_dir, profile)
    components = [component] if component else list(COMPONENTS)
    records = read_records(ctx.state_dir, name)
    known = {comp: set(component_logs(ctx.state_dir, name, comp)) for comp in components}
    opened: dict[str, _Log] = {}
    try:
        _open_logs(ctx.state_dir, name, components, records, known, opened, out, lines, follow)
        if not opened and not follow:
            raise UsageError(
                f"no {component or 'engine or proxy'} log for profile {name} in {ctx.state_dir / name / 'logs'}"
            )
        if follow:
            _follow(ctx.state_dir, name, components, known, opened, out, poll_s, stop_after_s)
    finally:
        for log in opened.values():
            log.close()


def _open_logs(state_dir: Path, name: str, components, records, known, opened, out, lines: int, follow: bool) -> None:
    """Open each component's newest log (a deleted one through the process's open file) into
    `opened` and print its last `lines`."""
    for comp in components:
        record = records.get(comp)
        path = deleted_log(record) if record is not None and is_same_process(record) else None
        if path is not None:
            out.raw(
                f"[{comp}] ==> {record.log} was deleted while pid {record.pid} runs: read from its open file "
                f"{path} (the disk space is freed when it stops) <==\n"
            )
        path = path or newest_log(state_dir, name, comp)
        if path is None:
            continue
        try:
            opened[comp] = _Log(comp, path, out, known[comp])
        except OSError as exc:
            out.warn(f"cannot read the {comp} log {path}: {exc.strerror or exc}")
            continue
        opened[comp].tail(lines, follow)


def _follow(state_dir: Path, name: str, components, known, opened, out, poll_s: float, stop_after_s) -> None:
    """Follow the opened logs across rotations and restarts until interrupted (or `stop_after_s`)."""
    started = time.monotonic()
    while stop_after_s is None or time.monotonic() - started < stop_after_s:
        for comp in components:
            logs = component_logs(state_dir, name, comp)
            if comp in opened:
                opened[comp].poll(logs)
            elif logs:  # a component that had no log yet: its first one, from its start
                try:
                    opened[comp] = _Log(comp, logs[-1], out, known[comp])
                except OSError:
                    continue
                known[comp].update(logs)
                opened[comp].say(f"==> new log {logs[-1]} <==")
                opened[comp].read()
        if _reader_gone(out.stdout):
            raise BrokenPipeError(errno.EPIPE, "the reader of stdout is gone")
        time.sleep(poll_s)


def _reader_gone(stream) -> bool:
    """stdout is a pipe whose reader exited (`logs -f | grep -m1 ready`): with nothing new to
    write, no write would ever fail, so `-f` would wait forever."""
    try:
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return False
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR (the read end closed) is reported whatever is asked
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
