"""The state dir: per-profile component records (JSON), log files and the lock file.

Layout (mode 0700):
    <state>/lock                       flock taken by every mutating command (its holder as JSON)
    <state>/<profile>/<component>.json one record per running component (engine, proxy)
    <state>/<profile>/logs/            timestamped log files
A record names a process by pid *and* start time (clock ticks since boot, with the boot id: see
`molctl.procid`), carries the id of the marker its processes inherit, and the configuration the
stack was started with (so `up` and `status` never guess it from a profile file edited since).
"""

from __future__ import annotations

import errno
import json
import os
import time
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from molctl.errors import ConflictError, MolctlError
from molctl.flocks import holder_if_held, try_exclusive

COMPONENTS = ("engine", "proxy")
LEGACY_TOLERANCE_S = 0.05  # psutil create_time resolution (records without start ticks)


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
    start_ticks: int | None = None  # /proc/PID/stat field 22: immune to wall-clock steps
    boot_id: str | None = None
    record_id: str = ""  # the marker (MOLCTL_RECORD_ID) every process of the component inherits
    host: str = "127.0.0.1"
    config: dict = field(default_factory=dict)  # see molctl.stackconfig


@dataclass
class RecordProblem:
    """A record file that exists but cannot be read or parsed."""

    component: str
    path: Path
    error: str


def record_path(state_dir: Path, profile: str, component: str) -> Path:
    return state_dir / profile / f"{component}.json"


def _parse_record(text: str) -> Record:
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    known = {f.name for f in fields(Record)}
    record = Record(**{k: v for k, v in data.items() if k in known})
    if not isinstance(record.pid, int) or not isinstance(record.pgid, int) or record.pid <= 0:
        raise ValueError("pid/pgid missing or not a positive integer")
    # a field of another type made status and up raise (`"port": "x"`), or made up take the live
    # stack for a stranger's and start a second one (`"start_ticks": "x"`)
    for name, allowed in _FIELD_TYPES.items():
        value = getattr(record, name)
        if isinstance(value, bool) or not isinstance(value, allowed):
            raise ValueError(f"field {name!r} is {type(value).__name__}")
    return record


def _json_types(hint: Any) -> tuple[type, ...]:
    """What a JSON value of a field annotated `hint` may be: `float` takes an int too (JSON writes
    1.0 as 1), `X | None` takes None, `list[str]` any list."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    out: list[type] = []
    for arg in args:
        arg = typing.get_origin(arg) or arg
        out += [int, float] if arg is float else [arg]
    return tuple(out)


# derived from Record's annotations, so a new field is checked without a second list to keep
_FIELD_TYPES = {name: _json_types(hint) for name, hint in typing.get_type_hints(Record).items()}


def read_records_checked(state_dir: Path, profile: str) -> tuple[dict[str, Record], list[RecordProblem]]:
    """The records of a profile, and the record files that exist but cannot be read."""
    out: dict[str, Record] = {}
    problems: list[RecordProblem] = []
    for component in COMPONENTS:
        path = record_path(state_dir, profile, component)
        try:
            text = path.read_text()
        except (FileNotFoundError, NotADirectoryError):  # no record (a state dir that is a file holds none)
            continue
        except OSError as exc:
            problems.append(RecordProblem(component, path, exc.strerror or str(exc)))
            continue
        except UnicodeDecodeError as exc:  # garbage bytes: a traceback from status, up and down
            problems.append(RecordProblem(component, path, f"corrupt (not UTF-8: {exc.reason} at byte {exc.start})"))
            continue
        try:
            out[component] = _parse_record(text)
        except (ValueError, TypeError) as exc:
            problems.append(RecordProblem(component, path, f"corrupt ({type(exc).__name__}: {exc})"[:200]))
    return out, problems


def read_records(state_dir: Path, profile: str) -> dict[str, Record]:
    return read_records_checked(state_dir, profile)[0]


def write_record(state_dir: Path, profile: str, record: Record) -> None:
    """Atomic write (temp file + rename + fsync): a crash never leaves a half-written record."""
    path = record_path(state_dir, profile, record.component)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            data = json.dumps(asdict(record), indent=1).encode()
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written file left in the state dir
        raise


def liveness(record: Record) -> str:
    """'alive' (the recorded process runs), 'gone' (it does not: the pid is free or now names
    another process) or 'uncertain' (a record without start ticks whose pid lives with another
    create time: a reused pid, or a wall-clock step; never signalled, its record kept)."""
    from molctl import procid

    if record.start_ticks is not None and procid.have_proc():
        if record.boot_id and procid.boot_id() and record.boot_id != procid.boot_id():
            return "gone"  # recorded before a reboot
        ticks = procid.start_ticks(record.pid)
        return "alive" if ticks is not None and ticks == record.start_ticks else "gone"
    import psutil

    try:
        proc = psutil.Process(record.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "gone"
        if abs(proc.create_time() - record.create_time) < LEGACY_TOLERANCE_S:
            return "alive"
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.AccessDenied:
        return "uncertain"
    env = procid.environ_of(record.pid)
    if record.record_id and env is not None:
        return "alive" if env.get(procid.MARKER_ID) == record.record_id else "gone"
    return "uncertain"


def is_same_process(record: Record) -> bool:
    """True when the record's pid is alive and is still the process that was recorded."""
    return liveness(record) == "alive"


def remove_record(state_dir: Path, profile: str, component: str) -> None:
    """Remove the record and the run dirs its spawns worked in (`procid.run_dir`); a process
    still in one keeps its marker (its working directory reads '... (deleted)')."""
    import shutil

    path = record_path(state_dir, profile, component)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(path.parent / f"{component}.run", ignore_errors=True)


def profiles_with_records(state_dir: Path) -> list[str]:
    """Profiles with a record file (readable or not). A state dir that exists but is no directory
    is an error (StateDirError): `status` and `down` said "nothing running" about it."""
    try:
        if not state_dir.is_dir():
            if state_dir.exists():
                raise StateDirError(
                    f"state dir {state_dir} is not a directory (choose another with --state-dir or MOLCTL_STATE_DIR)"
                )
            return []
        return sorted(
            d.name
            for d in state_dir.iterdir()
            if d.is_dir() and any(record_path(state_dir, d.name, c).exists() for c in COMPONENTS)
        )
    except OSError:
        return []


def log_dir(state_dir: Path, profile: str) -> Path:
    return state_dir / profile / "logs"


def new_log_path(state_dir: Path, profile: str, component: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = log_dir(state_dir, profile) / f"{component}-{stamp}"
    path, n = base.with_suffix(".log"), 1
    while path.exists():
        path = Path(f"{base}-{n}.log")
        n += 1
    return path


def component_logs(state_dir: Path, profile: str, component: str) -> list[Path]:
    """The component's log files, oldest first (rotated `.log.N` parts are not listed)."""
    try:
        logs = list(log_dir(state_dir, profile).glob(f"{component}-*.log"))
        return sorted(logs, key=lambda p: (p.stat().st_mtime, p.name))
    except OSError:
        return []


def newest_log(state_dir: Path, profile: str, component: str) -> Path | None:
    logs = component_logs(state_dir, profile, component)
    return logs[-1] if logs else None


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


def prune_logs(state_dir: Path, profile: str, component: str, keep: int, in_use: set[str] = frozenset()) -> list[Path]:
    """Delete all but the `keep` newest log files of a component (with their rotated parts);
    a file a live record names is never deleted. Returns what was deleted."""
    logs = component_logs(state_dir, profile, component)
    old = [p for p in logs[:-keep] if str(p) not in in_use] if keep > 0 else []
    removed = []
    for path in old:
        for part in [path, *path.parent.glob(path.name + ".*")]:
            try:
                part.unlink()
                removed.append(part)
            except OSError:
                pass
    return removed


class StateDirError(MolctlError):
    """The state dir cannot be created, read or written (one line, exit 1)."""


def ensure_state_dir(state_dir: Path) -> None:
    """Create the state dir with mode 0700, or refuse one that others can read (exit 3) or that
    cannot be used (a one-line error)."""
    import stat

    from molctl.errors import ProfileError

    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = state_dir.stat()
    except OSError as exc:
        raise StateDirError(
            f"state dir {state_dir} is not usable: {exc.strerror or exc} "
            f"(choose another with --state-dir or MOLCTL_STATE_DIR)"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise StateDirError(f"state dir {state_dir} is not a directory")
    if st.st_uid != os.geteuid():  # its records name the pids we signal, its files the paths we write
        raise ProfileError(_foreign(state_dir, st.st_uid))
    if st.st_mode & 0o077:
        raise ProfileError(
            f"state dir {state_dir} has mode {stat.S_IMODE(st.st_mode):04o}, expected 0700 "
            f"(records and logs may hold secrets): chmod 700 {state_dir}"
        )


def user_name(uid: int) -> str | None:
    """The login name of `uid`, or None when the passwd database has none (a container's uid)."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def _foreign(state_dir: Path, uid: int) -> str:
    name = user_name(uid)
    owner = f"{name} (uid {uid})" if name else f"uid {uid}"
    return (
        f"state dir {state_dir} is owned by {owner}, not by you (uid {os.geteuid()}): its records could name "
        f"any process to signal and its files any path to write; run molctl as its owner, or choose another "
        f"with --state-dir or MOLCTL_STATE_DIR"
    )


def check_own_state_dir(state_dir: Path) -> None:
    """Refuse (StateDirError, exit 1) a state dir that exists and is owned by another user, before
    a command acts on its records (`down`, `reload`, `bench`, `state prune`): whoever owns it
    writes them, and a record names the pid that is signalled, the host a key is sent to. Root
    running `molctl down` on a user's state dir (a shared parent, MOLCTL_STATE_DIR=/tmp/...) would
    kill any process a forged record names. A missing state dir is left to the command."""
    try:
        st = os.stat(state_dir)
    except OSError:
        return
    if st.st_uid != os.geteuid():
        raise StateDirError(_foreign(state_dir, st.st_uid))


def check_readable(state_dir: Path) -> None:
    """A state dir that exists but cannot be listed (another user's, mode 0700) is an error
    (exit 1) for the read-side commands: `status` said "no stack is recorded" about it, `logs`
    "no logs"."""
    try:
        os.listdir(state_dir)
    except (FileNotFoundError, NotADirectoryError):  # none yet: nothing recorded; a file: profiles_with_records says so
        return
    except OSError as exc:
        try:
            st = os.stat(state_dir)
            owner = user_name(st.st_uid) or f"uid {st.st_uid}"
        except OSError:
            owner, st = "?", None
        mode = f", mode {st.st_mode & 0o777:o}" if st is not None else ""
        raise StateDirError(
            f"cannot read state dir {state_dir}: {exc.strerror or exc} (owner {owner}{mode}): "
            f"run molctl as {owner}, or choose the state dir with --state-dir"
        ) from None


@dataclass(frozen=True)
class LockHolder:
    """Who holds the state lock: the lock file's JSON content as fields, never parsed from text.
    `action` is the mutating command (up, down, switch); `profile` the stack it acts on (None for
    a `down` of every stack). Any field may be missing in a file written by something else."""

    pid: int | None
    action: str | None = None
    profile: str | None = None
    user: str | None = None
    since: float | None = None

    @classmethod
    def parse(cls, raw: bytes) -> LockHolder:
        try:
            data = json.loads(raw.decode(errors="replace").strip() or "{}")
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}

        def typed(key: str, kind: type | tuple[type, ...]):
            value = data.get(key)
            return value if isinstance(value, kind) and not isinstance(value, bool) else None

        return cls(
            typed("pid", int),
            typed("action", str),
            typed("profile", str),
            typed("user", str),
            typed("since", (int, float)),
        )

    def as_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "action": self.action, "profile": self.profile, "user": self.user, "since": self.since}

    @property
    def command(self) -> str:
        return " ".join(x for x in (self.action, self.profile) if x) or "?"

    def describe(self) -> str:
        when = f", since {time.strftime('%H:%M:%S', time.localtime(self.since))}" if self.since is not None else ""
        user = f", user {self.user}" if self.user else ""
        return f"pid {self.pid if self.pid is not None else '?'} (molctl {self.command}{user}{when})"

    def stop_hint(self) -> str:
        if self.pid is None:
            return "wait for it"
        # SIGTERM, not SIGINT: a non-interactive shell starts its background jobs (`molctl up &`
        # in a script) with SIGINT ignored; `up` and `switch` clean up on SIGTERM as on Ctrl-C
        then = " (SIGTERM: it stops what it started)" if self.action in ("up", "switch") else ""
        return f"wait for it, or stop it with `kill {self.pid}`{then}"


def _read_holder(fd: int) -> LockHolder:
    return LockHolder.parse(os.pread(fd, 4096, 0))


class StateLock:
    """flock on <state>/lock for every mutating command; a second one fails fast (exit 4)
    naming the holder and how to stop it. The kernel drops the lock when the holder dies: never
    stale. The holder is a `LockHolder` as JSON: {"pid", "action", "profile", "user", "since"}."""

    def __init__(self, state_dir: Path, action: str, profile: str | None = None):
        self.path = state_dir / "lock"
        self.action, self.profile = action, profile
        self.fd: int | None = None

    def __enter__(self) -> StateLock:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise StateDirError(f"cannot take the state lock {self.path}: {exc.strerror or exc}") from None
        if not try_exclusive(fd):
            holder = _read_holder(fd)
            os.close(fd)
            raise ConflictError(
                f"the state lock {self.path} is held by {holder.describe()}; {holder.stop_hint()}"
            ) from None
        import getpass

        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = str(os.getuid())
        holder = LockHolder(os.getpid(), self.action, self.profile, user, time.time())
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder.as_dict()) + "\n").encode(), 0)
        except OSError:  # a full disk: the lock is held all the same, its holder unnamed (`down` must still stop)
            pass
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, 0)
            except OSError:
                pass
            os.close(self.fd)  # closing releases the flock
            self.fd = None


def lock_holder(state_dir: Path) -> LockHolder | None:
    """Who holds the state lock right now (for status), or None."""
    return holder_if_held(state_dir / "lock", _read_holder, nofollow=False)
