"""flock helpers shared by the state lock (`molctl.state`) and the host-wide port/GPU claims
(`molctl.claims`): both are files held with `flock` whose content names the holder."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def holder_if_held(path: Path, read: Callable[[int], T], nofollow: bool = True) -> T | None:
    """`read(fd)` of the lock file at `path` while someone holds it, or None when nobody does (or
    the file does not exist). Probes with a shared lock for an instant, so an exclusive taker
    retries briefly (`try_exclusive`)."""
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_NOFOLLOW if nofollow else 0))
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return read(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def try_exclusive(fd: int, tries: int = 5, pause_s: float = 0.02) -> bool:
    """LOCK_EX without blocking, retried `tries` times: a prober may hold LOCK_SH for an instant."""
    for i in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if i < tries - 1:
                time.sleep(pause_s)
    return False
