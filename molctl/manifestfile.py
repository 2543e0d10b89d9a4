"""A manifest of `molctl lock` as a file: where it lives (`manifest_dir`, `default_path`:
`STATE/PROFILE/manifests/lock-<UTC time>.json`, `newest`), written atomically (`write_atomic`:
temp file, fsync, rename, so Ctrl-C never leaves a half-written one; `prepare_output` proves the
place writable first) and read back (`read`: kind, format and shape checked, one line naming the
file and field otherwise). molctl.manifest builds what goes in it."""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Any

from molctl.errors import ExitStatus, MolctlError, UsageError

FORMAT = 1


KIND = "molctl.lock"


class ManifestError(MolctlError):
    """The manifest cannot be built or read (exit 3: the layout or the engine is not lockable)."""

    exit_status = ExitStatus.CHECK_FAILED


def _molctl_version() -> str:
    from molctl import __version__

    return __version__


# ----------------------------------------------------------------------------------- files on disk
def manifest_dir(state_dir: Path, profile: str) -> Path:
    return Path(state_dir) / profile / "manifests"


def default_path(state_dir: Path, profile: str, now: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    path = manifest_dir(state_dir, profile) / f"lock-{stamp}.json"
    while path.exists():
        path = _next_name(path)
    return path


_DEFAULT_NAME = re.compile(r"(lock-\d{8}-\d{6})(?:-(\d+))?\.json")


def _next_name(path: Path) -> Path:
    """lock-STAMP.json -> lock-STAMP-2.json -> lock-STAMP-3.json (any other name: NAME-2.json)."""
    m = _DEFAULT_NAME.fullmatch(path.name)
    stem, n = (m.group(1), int(m.group(2) or 1)) if m else (path.stem, 1)
    return path.with_name(f"{stem}-{n + 1}.json")


def write_atomic(path: Path, manifest: dict[str, Any], replace: bool = True) -> Path:
    """Temp file in the same folder, fsync, rename: the path holds the whole manifest or nothing.
    With `replace` False an existing file is never replaced: the manifest takes the next free
    `-N` name (two `molctl lock` started in the same second chose the same default name; a hard
    link is the atomic claim). Returns where it went."""
    path = Path(path).absolute()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # a name of its own (two writers never share a temp file), created like any file (umask)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with open(fd, "w", encoding="utf-8") as fh:
            json.dump(manifest, fh, indent=2)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            path = _link_new(tmp, path)
    finally:
        try:
            tmp.unlink()
        except OSError:
            pass
    return path


def _link_new(tmp: Path, path: Path) -> Path:
    """Hard-link `tmp` at `path` or, when taken, at the next free name; a file system without
    hard links gets the rename, after an existence check (a race there is the only window left)."""
    while True:
        try:
            os.link(tmp, path)
            return path
        except FileExistsError:
            path = _next_name(path)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            while path.exists():
                path = _next_name(path)
            os.replace(tmp, path)
            return path


def newest(state_dir: Path, profile: str) -> Path | None:
    """The profile's newest manifest written by `molctl lock` (by mtime, then name), or None."""
    d = manifest_dir(state_dir, profile)
    try:
        found = [p for p in d.glob("lock-*.json") if p.is_file()]
    except OSError:
        return None
    return max(found, key=lambda p: (p.stat().st_mtime_ns, p.name)) if found else None


def read(path: Path) -> dict[str, Any]:
    from molctl.hashing import file_kind

    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # a FIFO would block, /dev/zero never ends
            raise ManifestError(f"manifest {path} is {file_kind(mode)}, not a regular file")
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"manifest {path} does not exist") from None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ManifestError(f"manifest {path} cannot be read: {why}") from None
    problem = _kind_problem(data)
    if problem:
        raise ManifestError(f"{path} {problem}")
    problem = _shape_problem(data)
    if problem:
        raise ManifestError(
            f"{path} is not a valid molctl lock manifest: {problem} (write a new one: molctl lock PROFILE)"
        )
    return data


_JSON_TYPES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def _kind_problem(data: Any) -> str | None:
    """What makes a JSON document other than a manifest this molctl reads, in words naming the
    field, the value found and the one expected; None for a `molctl.lock` of format 1."""
    if not isinstance(data, dict):
        return f"is not a molctl lock manifest: {_JSON_TYPES.get(type(data), 'a value')} in JSON, expected an object"
    if data.get("kind") != KIND:
        return f"is not a molctl lock manifest: field 'kind' is {data.get('kind')!r}, expected {KIND!r}"
    if data.get("format") != FORMAT:
        by = f" (written by molctl {data['molctl_version']})" if isinstance(data.get("molctl_version"), str) else ""
        return (
            f"is a molctl lock manifest of format {data.get('format')!r}{by}; this molctl reads format {FORMAT} "
            f"(molctl {_molctl_version()}): write a new one with molctl lock PROFILE"
        )
    return None


_ENTRY = {"name": str, "size": int, "mtime_ns": int, "sha256": str}


def _shape_problem(m: dict[str, Any]) -> str | None:
    """The first field of a manifest whose type is not what `molctl lock` writes (a hand-edited or
    damaged file must be one line, not a traceback in `check --verify`), or None."""

    def kind(value, want) -> bool:
        return isinstance(value, want) and not (want is int and isinstance(value, bool))

    for key, want in (
        ("profile", str),
        ("engine", dict),
        ("argv", list),
        ("env", dict),
        ("config", dict),
        ("capacity", dict),
        ("shards", list),
        ("base_files", list),
        ("adapters", dict),
    ):
        if not kind(m.get(key), want):
            return f"field {key!r} is missing or not a {want.__name__}"
    if m.get("template") is not None and not (
        isinstance(m["template"], dict) and isinstance(m["template"].get("sha256"), str)
    ):
        return "field 'template' is neither null nor an object with a 'sha256'"
    if not all(isinstance(a, str) for a in m["argv"]):
        return "field 'argv' holds a non-string"
    if not all(isinstance(v, str) for v in m["env"].values()):
        return "field 'env' holds a non-string value"
    lists = [("shards", m["shards"]), ("base_files", m["base_files"])]
    for route, adapter in m["adapters"].items():
        if not isinstance(adapter, dict) or not isinstance(adapter.get("files"), list):
            return f"field 'adapters.{route}' is not an object with a 'files' list"
        lists.append((f"adapters.{route}.files", adapter["files"]))
    for where, entries in lists:
        for i, e in enumerate(entries):
            if not isinstance(e, dict):
                return f"field '{where}[{i}]' is not an object"
            for key, want in _ENTRY.items():
                if not kind(e.get(key), want):
                    return f"field '{where}[{i}].{key}' is missing or not a {want.__name__}"
            if not _inside(e["name"]):  # verify reads it: never a path out of the layout
                return f"field '{where}[{i}].name' {e['name']!r} is not a path inside its folder"
    return None


def _inside(name: str) -> bool:
    """A relative path that stays inside its folder (no `/etc/passwd`, no `../x`; no NUL, which no path holds)."""
    return (
        bool(name) and "\0" not in name and not os.path.isabs(name) and os.path.normpath(name).split(os.sep)[0] != ".."
    )


def prepare_output(path: Path) -> Path:
    """The manifest's absolute path, its folder created and proven writable (a temp file created
    and removed). A directory is a usage error (exit 2); an unwritable place exit 1."""
    path = Path(path).absolute()
    if path.is_dir():
        raise UsageError(f"--output {path} is a directory: give the manifest's file name, e.g. {path / 'lock.json'}")
    # a name of its own, created new (O_EXCL, never through a symlink planted under a guessable name)
    probe = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except OSError as exc:
        raise MolctlError(f"cannot write the manifest {path}: {exc.strerror or exc}") from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return path
