"""Host-wide claims on TCP ports and GPU indices, across users and state dirs.

The state lock only serialises the commands of one state dir; two operators (two users, two
state dirs) starting at the same moment would both find a port free by `bind()`, and vLLM's
SO_REUSEPORT would then let two engines share it. So before spawning, `up` claims every port of
the stack and every GPU index the engine uses: one claim file per port / device in a host-wide
claim dir (`MOLCTL_LOCK_DIR`, else `/run/lock/molctl`, else `<tmp>/molctl-locks`; mode 1777
like /tmp, each file owned by its creator), taken with `flock` and inherited by the component
process (`pass_fds`), so it is held exactly as long as that process lives: the kernel frees it
on any exit, and no stale lock can exist. The file's content names the holder (JSON: pid, user,
profile, component, state dir), which `check`, `up` and `switch` show.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from molctl.errors import ConflictError, MolctlError
from molctl.flocks import holder_if_held, try_exclusive

CLAIM_DIR_ENV = "MOLCTL_LOCK_DIR"


def claim_dir() -> Path:
    env = os.environ.get(CLAIM_DIR_ENV)
    if env:
        return Path(env).expanduser()
    run = Path("/run/lock")
    if run.is_dir() and os.access(run, os.W_OK | os.X_OK):
        return run / "molctl"
    return Path(tempfile.gettempdir()) / "molctl-locks"


def _ensure_dir(d: Path) -> None:
    try:
        os.mkdir(d, 0o1777)
        os.chmod(d, 0o1777)  # the umask trimmed the mode; like /tmp: everyone creates, only owners delete
    except FileExistsError:
        pass
    except OSError as exc:
        raise MolctlError(f"cannot create the host lock dir {d}: {exc.strerror or exc} (set {CLAIM_DIR_ENV})") from None
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise MolctlError(f"host lock dir {d} is not a directory (set {CLAIM_DIR_ENV})")


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


@dataclass(frozen=True)
class Holder:
    """Who holds a claim, from the lock file's content (any field may be missing)."""

    pid: int | None
    user: str | None
    profile: str | None
    component: str | None
    state_dir: str | None
    command: str | None = None

    @classmethod
    def parse(cls, raw: bytes) -> Holder:
        try:
            data = json.loads(raw.decode(errors="replace") or "{}")
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        pid = data.get("pid")

        def text(key: str) -> str | None:  # the file is world-writable: anything else is not a name
            value = data.get(key)
            return value if isinstance(value, str) and value else None

        return cls(
            pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
            text("user"),
            text("profile"),
            text("component"),
            text("state_dir"),
            text("command"),
        )

    def owns(self, state_dir: Path | None, profiles: Iterable[str]) -> bool:
        """True when this claim belongs to one of `profiles` run from `state_dir`."""
        if state_dir is None or self.state_dir is None:
            return False
        return _same_dir(self.state_dir, state_dir) and self.profile in set(profiles)

    def describe(self) -> str:
        who = []
        if self.pid is not None:
            who.append(f"pid {self.pid} ({_process_name(self.pid)})")
        if self.user:
            who.append(f"user {self.user}")
        if self.profile:
            who.append(f"profile {self.profile}" + (f" {self.component}" if self.component else ""))
        if self.state_dir:
            who.append(f"state dir {self.state_dir}")
        return ", ".join(who) or "another process (the lock file names no holder)"

    def stop_hint(self) -> str:
        """The command that stops the holder, for the operator to copy: built from the lock file,
        which any local user can write, so the state dir is shell-quoted and a profile that is
        not a profile name gives no command at all."""
        import shlex

        from molctl.profiles import NAME_RE

        if self.profile and self.state_dir and NAME_RE.match(self.profile):
            as_user = f" (as user {self.user})" if self.user and self.user != _user() else ""
            return f"stop it with `molctl --state-dir {shlex.quote(self.state_dir)} down {self.profile}`{as_user}"
        return "stop that process first"


def _same_dir(a: str | Path, b: str | Path) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except OSError:
        return str(a) == str(b)


def _process_name(pid: int) -> str:
    from molctl.probes import _process_name as name

    return name(pid)


class ClaimConflict(ConflictError):
    def __init__(self, what: str, holder: Holder):
        super().__init__(f"{what} is claimed by {holder.describe()}; {holder.stop_hint()}")
        self.what, self.holder = what, holder


@dataclass
class Claim:
    kind: str  # "port" | "gpu"
    key: int
    path: Path
    fd: int | None

    @property
    def what(self) -> str:
        return f"port {self.key}" if self.kind == "port" else f"GPU {self.key}"

    def set_holder(self, info: Mapping[str, Any]) -> None:
        if self.fd is None:
            return
        # Never an empty file while held (a reader would name no holder): one write of the new
        # content padded over the old one (JSON ignores trailing blanks), then trim it.
        data = (json.dumps(dict(info)) + "\n").encode()
        try:
            old = os.fstat(self.fd).st_size
            os.pwrite(self.fd, data.ljust(max(old, len(data)), b" "), 0)
            os.ftruncate(self.fd, len(data))
        except OSError:
            pass  # a lock file created by another user may be read-only to us: the claim holds anyway

    def release(self) -> None:
        """Close molctl's own descriptor: the lock stays held while a child inherited it."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class HostClaims:
    def __init__(self, directory: Path | None = None):
        self.dir = directory or claim_dir()

    def path(self, kind: str, key: int) -> Path:
        return self.dir / f"{kind}-{key}.lock"

    def holder(self, kind: str, key: int) -> Holder | None:
        """The holder of a claim, or None when nobody holds it."""
        return holder_if_held(self.path(kind, key), _read_holder)

    def acquire(self, kind: str, key: int, info: Mapping[str, Any]) -> Claim:
        _ensure_dir(self.dir)
        path = self.path(kind, key)
        try:
            fd = _open_lock_file(path)
        except OSError as exc:
            raise MolctlError(f"cannot open the host lock {path}: {exc.strerror or exc}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            # a hard link another user made to a file of ours (fs.protected_hardlinks=0): writing
            # the holder over it would overwrite that file
            os.close(fd)
            raise MolctlError(
                f"host lock {path} is not a plain file of its own (a hard link or a special file): "
                f"remove it, or set {CLAIM_DIR_ENV}"
            )
        if not try_exclusive(fd):
            holder = _read_holder(fd)
            os.close(fd)
            raise ClaimConflict(f"port {key}" if kind == "port" else f"GPU {key}", holder)
        claim = Claim(kind, key, path, fd)
        claim.set_holder(info)
        return claim


def _read_holder(fd: int, wait_s: float = 1.0) -> Holder:
    """The holder named in a held lock file. A claim taken an instant ago may not have written
    its name yet (created empty, then locked, then written): wait up to `wait_s` for it."""
    deadline = time.monotonic() + wait_s
    while True:
        holder = Holder.parse(os.pread(fd, 4096, 0))
        if holder != Holder.parse(b"") or time.monotonic() >= deadline:
            return holder
        time.sleep(0.02)


def _open_lock_file(path: Path) -> int:
    """Open (or create) a lock file for writing its holder. An existing file is opened without
    O_CREAT (with fs.protected_regular, O_CREAT on another user's file in a sticky directory is
    refused); a new one is created 0666 (its creator owns it; whoever holds it next writes its
    name in it); a file we may not write is opened read-only (flock works on it all the same)."""
    flags = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(3):
        try:
            return os.open(path, os.O_RDWR | flags)
        except FileNotFoundError:
            pass
        except PermissionError:
            return os.open(path, os.O_RDONLY | flags)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flags, 0o644)
        except FileExistsError:
            continue  # created by someone else meanwhile
        try:
            os.fchmod(fd, 0o666)
        except OSError:
            pass
        return fd
    return os.open(path, os.O_RDONLY | flags)


def holder_info(
    profile: str, component: str, state_dir: Path, pid: int | None = None, command: str | None = None
) -> dict[str, Any]:
    return {
        "pid": pid or os.getpid(),
        "user": _user(),
        "uid": os.getuid(),
        "profile": profile,
        "component": component,
        "state_dir": str(state_dir.absolute()),
        "command": command,
        "since": time.time(),
    }


def gpu_indices(profile, environ: Mapping[str, str]) -> list[int]:
    """The GPU indices the engine will use: CUDA_VISIBLE_DEVICES (profile env first) or the first N."""
    want = profile.engine.gpus
    if want <= 0:
        return []
    visible = profile.engine.env.get("CUDA_VISIBLE_DEVICES", environ.get("CUDA_VISIBLE_DEVICES"))
    if visible:
        try:
            return [int(x) for x in visible.split(",") if x.strip()][:want]
        except ValueError:
            pass  # UUIDs: fall back to the first N devices
    return list(range(want))


def stack_claims(profile) -> dict[str, list[tuple[str, int]]]:
    """What each component claims: the engine its port and GPUs, the proxy its port (and its
    metrics port when set)."""
    metrics = getattr(getattr(profile, "proxy", None), "metrics_port", None)
    return {
        "engine": [("port", profile.engine.port)] + [("gpu", i) for i in gpu_indices(profile, os.environ)],
        "proxy": [("port", profile.proxy.port)] + ([("port", metrics)] if metrics else []),
    }


def claim_components(
    host: HostClaims, profile, state_dir: Path, components: Iterable[str], command: str
) -> dict[str, list[Claim]]:
    """Claim everything the given components need, all or nothing (ClaimConflict names the holder)."""
    wanted = stack_claims(profile)
    taken: dict[str, list[Claim]] = {}
    try:
        for component in components:
            taken[component] = []
            for kind, key in wanted[component]:
                info = holder_info(profile.name, component, state_dir, command=command)
                taken[component].append(host.acquire(kind, key, info))
    except BaseException:
        release_all(taken)
        raise
    return taken


def release_all(claims: Mapping[str, list[Claim]]) -> None:
    for group in claims.values():
        for claim in group:
            claim.release()
