"""How molctl's own processes write their log files, beside `molctl logs` (which reads them):
control characters escaped (`escape_controls`, `EscapingFormatter`: a log never drives the
reader's terminal) and size-based rotation of the file stdout/stderr write to (`rotate_stdio`)."""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from pathlib import Path

# C0 controls but tab and line feed, DEL and the C1 controls (0x9b is a one-character CSI)
CONTROLS_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def escape_controls(text: str) -> str:
    """`text` with its terminal control characters shown as `\\xNN` (ESC, BEL, backspace, CR,
    DEL, C1), so a log line cannot colour, move or rewrite the reader's terminal; tabs and line
    feeds stay. Used when `molctl logs` prints a line and when the proxy writes its log."""
    return CONTROLS_RE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class EscapingFormatter(logging.Formatter):
    """A logging.Formatter whose lines have their control characters escaped (escape_controls)."""

    def format(self, record: logging.LogRecord) -> str:
        return escape_controls(super().format(record))


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
