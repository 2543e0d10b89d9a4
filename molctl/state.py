"""The state dir: per-profile component records (JSON), log files and the lock file.

Layout (mode 0700):
    <state>/lock                       flock taken by every mutating command
    <state>/<profile>/<component>.json one record per running component (engine, proxy)
    <state>/<profile>/logs/            timestamped log files
A record names a process by pid *and* create time; a pid whose process has another create time
is someone else's now and is never signalled.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

COMPONENTS = ("engine", "proxy")


def default_state_dir() -> Path:
    env = os.environ.get("MOLCTL_STATE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"
    return base / "molctl"


@dataclass
class Record:
    component: str
    pid: int
    pgid: int
    create_time: float
    argv: list[str]
    port: int
    log: str
    started_at: float
    extra: dict = field(default_factory=dict)


def record_path(state_dir: Path, profile: str, component: str) -> Path:
    return state_dir / profile / f"{component}.json"


def read_records(state_dir: Path, profile: str) -> dict[str, Record]:
    out: dict[str, Record] = {}
    for component in COMPONENTS:
        path = record_path(state_dir, profile, component)
        try:
            data = json.loads(path.read_text())
            out[component] = Record(**data)
        except (OSError, ValueError, TypeError):
            continue
    return out


def write_record(state_dir: Path, profile: str, record: Record) -> None:
    """Atomic write (temp file + rename): a crash never leaves a half-written record."""
    path = record_path(state_dir, profile, record.component)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(asdict(record), indent=1))
    os.replace(tmp, path)


def is_same_process(record: Record) -> bool:
    """True when the record's pid is alive and is still the process that was recorded."""
    import psutil

    try:
        proc = psutil.Process(record.pid)
        return abs(proc.create_time() - record.create_time) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def remove_record(state_dir: Path, profile: str, component: str) -> None:
    try:
        record_path(state_dir, profile, component).unlink()
    except FileNotFoundError:
        pass


def profiles_with_records(state_dir: Path) -> list[str]:
    if not state_dir.is_dir():
        return []
    return sorted(d.name for d in state_dir.iterdir()
                  if d.is_dir() and any(record_path(state_dir, d.name, c).exists() for c in COMPONENTS))


def new_log_path(state_dir: Path, profile: str, component: str) -> Path:
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = state_dir / profile / "logs" / f"{component}-{stamp}"
    path, n = base.with_suffix(".log"), 1
    while path.exists():
        path = Path(f"{base}-{n}.log")
        n += 1
    return path


def newest_log(state_dir: Path, profile: str, component: str) -> Path | None:
    logs = sorted((state_dir / profile / "logs").glob(f"{component}-*.log"), key=lambda p: (p.stat().st_mtime, p.name))
    return logs[-1] if logs else None


def ensure_state_dir(state_dir: Path) -> None:
    """Create the state dir with mode 0700, or refuse one that others can read (exit 3)."""
    import stat

    from molctl.errors import ProfileError

    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = state_dir.stat()
    if st.st_mode & 0o077:
        raise ProfileError(f"state dir {state_dir} has mode {stat.S_IMODE(st.st_mode):04o}, expected 0700 "
                           f"(records and logs may hold secrets): chmod 700 {state_dir}")


class StateLock:
    """flock on <state>/lock for every mutating command; a second one fails fast (exit 4)
    naming the holder. The kernel drops the lock when the holder dies: never stale."""

    def __init__(self, state_dir: Path, command: str):
        self.path = state_dir / "lock"
        self.command = command
        self.fd: int | None = None

    def __enter__(self) -> "StateLock":
        import fcntl

        from molctl.errors import ConflictError

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "another molctl"
            os.close(fd)
            raise ConflictError(f"the state lock {self.path} is held by {holder}; wait for it or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} (molctl {self.command})\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)  # closing releases the flock
            self.fd = None


def lock_holder(state_dir: Path) -> str | None:
    """Who holds the lock right now (for status), or None."""
    import fcntl

    path = state_dir / "lock"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.read(fd, 512).decode(errors="replace").strip() or "another molctl"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
