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


def stack_pids(state_dir: Path, profile: str) -> set[int]:
    """Pids of this profile's live recorded components and all their descendants."""
    import psutil

    pids: set[int] = set()
    for record in read_records(state_dir, profile).values():
        if not is_same_process(record):
            continue
        pids.add(record.pid)
        try:
            pids.update(c.pid for c in psutil.Process(record.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.pid) == record.pgid:
                    pids.add(proc.pid)
            except (ProcessLookupError, PermissionError):
                continue
    return pids
