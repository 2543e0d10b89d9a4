"""SHA-256 of many large files, as fast as the disks allow, remembered between runs.

- Parallel over files: a `ThreadPoolExecutor` of `jobs` workers (default: the cores, at most 8).
  hashlib releases the GIL while it hashes a large buffer, and reads release it too, so threads
  scale like processes here without pickling anything.
- Large reads: 8 MiB `readinto` a buffer reused per file (no allocation per read).
- A hash cache, `STATE/cache/hashes.json`, keyed by the file's real path and checked against its
  size, mtime_ns and inode: an unchanged file is never read again, so an unchanged 700 GB layout
  re-locks in the time it takes to stat it. The cache is written atomically (temp file, rename)
  as files finish (at most every `SAVE_EVERY_S`, and always at the end or on an interruption),
  so an interrupted run resumes: the next one hashes only what was not finished.
- `progress` (optional) learns the total and each chunk read (`molctl.output.HashProgress`
  draws a bar with bytes/s and ETA on a terminal).

`hash_files(..., hasher=...)` takes another hasher (tests count calls or inject a Ctrl-C).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

CHUNK = 8 * 1024 * 1024
MAX_JOBS = 8
SAVE_EVERY_S = 1.0
CACHE_NAME = "hashes.json"
CACHE_FORMAT = 1
_HEX64 = re.compile(r"[0-9a-f]{64}")


ROTATIONAL_JOBS = 2  # a spinning disk loses more to seeks than it gains from more parallel streams


def default_jobs(path: str | Path | None = None, sysfs: str = "/sys") -> int:
    """One worker per core, at most 8 (more rarely helps a single device and costs memory: 8 MiB
    each); at most 2 when `path` lives on a device the kernel calls rotational (a disk, not flash;
    some virtual disks say so too: `--jobs` overrides)."""
    jobs = max(1, min(MAX_JOBS, os.cpu_count() or 1))
    if path is not None and _rotational(path, sysfs):
        jobs = min(jobs, ROTATIONAL_JOBS)
    return jobs


def _rotational(path: str | Path, sysfs: str) -> bool:
    try:
        dev = os.stat(path).st_dev
        base = Path(sysfs) / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}"
        for queue in (base / "queue" / "rotational", base / ".." / "queue" / "rotational"):  # disk, or partition
            if queue.exists():
                return queue.read_text().strip() == "1"
    except (OSError, ValueError):
        pass
    return False


class HashProgress(Protocol):
    def start(self, files: int, total_bytes: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...

    def close(self) -> None: ...


class Interrupted(Exception):
    """Raised inside a worker when the run is being stopped (Ctrl-C in the main thread)."""


class NotRegularFile(OSError):
    """A path to hash that is a FIFO, a device, a socket or a directory (a FIFO would block the read
    forever, /dev/zero never ends): never opened for reading."""


class FileChanged(OSError):
    """A file whose size, mtime or inode changed while it was being hashed: its digest is of no
    version of the file, so it is neither cached nor pinned."""


def file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _not_regular(path: str, real: str, mode: int) -> NotRegularFile:
    via = f" (through a symlink to {real})" if real != os.path.abspath(path) else ""
    return NotRegularFile(errno.EINVAL, f"is {file_kind(mode)}, not a regular file{via}", path)


@dataclass(frozen=True)
class FileStat:
    path: str  # as given
    real: str  # os.path.realpath
    size: int
    mtime_ns: int
    inode: int

    def key(self) -> dict:
        return {"size": self.size, "mtime_ns": self.mtime_ns, "inode": self.inode}


def stat_file(path: str | Path) -> FileStat:
    """Raises OSError when the file cannot be stat'ed (`filename`: the path as given, also for a
    dangling symlink), `NotRegularFile` for anything but a regular file."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror, str(path)) from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(str(path), real, st.st_mode)
    return FileStat(str(path), real, st.st_size, st.st_mtime_ns, st.st_ino)


def sha256_file(path: str, on_bytes: Callable[[int], None] | None = None, stop: threading.Event | None = None) -> str:
    """The file's SHA-256 (hex), read in 8 MiB chunks; `on_bytes(n)` after each chunk; a set
    `stop` event ends it with `Interrupted`. Opened without blocking and checked to be a regular
    file (a FIFO swapped in after the stat must not hang the run)."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(str(path), os.path.realpath(path), mode)
    except BaseException:
        os.close(fd)
        raise
    with open(fd, "rb", buffering=0) as fh:
        while True:
            if stop is not None and stop.is_set():
                raise Interrupted(path)
            n = fh.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            if on_bytes is not None:
                on_bytes(n)
    return h.hexdigest()


def _read_regular(path: Path) -> str:
    """The text of a regular file; anything else (a FIFO would block, a device never ends) is an OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with open(fd, "rb") as fh:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(str(path), os.path.realpath(path), mode)
        return fh.read().decode("utf-8")


class HashCache:
    """`STATE/cache/hashes.json`: {"format": 1, "files": {realpath: {size, mtime_ns, inode, sha256}}}.
    A `None` path keeps it in memory only."""

    def __init__(self, path: Path | None):
        self.path = path
        self.files: dict[str, dict] = {}
        self._dirty = False
        self._lock = threading.Lock()
        if path is not None:
            try:
                data = json.loads(_read_regular(path))
                if (
                    isinstance(data, dict)
                    and data.get("format") == CACHE_FORMAT
                    and isinstance(data.get("files"), dict)
                ):
                    self.files = data["files"]
            except (OSError, ValueError, RecursionError):  # missing, damaged, nested too deep: start empty
                pass

    @classmethod
    def in_state_dir(cls, state_dir: Path | None) -> HashCache:
        return cls(Path(state_dir) / "cache" / CACHE_NAME if state_dir is not None else None)

    def get(self, st: FileStat) -> str | None:
        entry = self.files.get(st.real)
        if not isinstance(entry, dict):
            return None
        digest = entry.get("sha256")
        if all(entry.get(k) == v for k, v in st.key().items()) and isinstance(digest, str) and _HEX64.fullmatch(digest):
            return digest
        return None  # unknown, changed, or a damaged entry: hashed again

    def put(self, st: FileStat, sha256: str) -> None:
        with self._lock:
            self.files[st.real] = {**st.key(), "sha256": sha256}
            self._dirty = True

    def prune(self) -> None:
        """Forget files that no longer exist (a deleted layout's entries), so the cache stays small."""
        with self._lock:
            gone = [p for p in self.files if not os.path.exists(p)]
            for p in gone:
                del self.files[p]
            self._dirty = self._dirty or bool(gone)

    def save(self) -> None:
        """Atomically (temp file in the same folder, then rename); a cache that cannot be written
        only costs the next run its speed."""
        if self.path is None or not self._dirty:
            return
        with self._lock:
            data = json.dumps({"format": CACHE_FORMAT, "files": self.files}, separators=(",", ":"))
            self._dirty = False
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(tmp, "w") as fh:
                fh.write(data)
            os.replace(tmp, self.path)
        except OSError:
            try:
                tmp.unlink()
            except OSError:
                pass


@dataclass
class HashRun:
    """What one `hash_files` did: sha256 per path given, and how much it had to read."""

    sha256: dict[str, str]
    stats: dict[str, FileStat] = field(default_factory=dict)  # the stat each digest belongs to (path as given)
    files: int = 0
    bytes: int = 0
    hashed_files: int = 0
    hashed_bytes: int = 0
    seconds: float = 0.0


Hasher = Callable[..., str]  # (path, on_bytes, stop) -> hex digest


def hash_files(
    paths: Iterable[str | Path],
    cache: HashCache | None = None,
    jobs: int | None = None,
    progress: HashProgress | None = None,
    hasher: Hasher | None = None,
    use_cache: bool = True,
    errors: dict[str, OSError] | None = None,
) -> HashRun:
    """SHA-256 of every path (raises OSError for a file that cannot be read; with `errors` given,
    such a file is recorded there by path and the others are still hashed, in the same parallel
    pass). With `use_cache` False every file is read (`check --verify --full-hash`); the fresh
    results still update the cache. Ctrl-C stops the workers, saves what finished and re-raises."""
    hasher = hasher or sha256_file
    cache = cache or HashCache(None)
    t0 = time.monotonic()
    stats = []
    for p in dict.fromkeys(str(p) for p in paths):
        try:
            stats.append(stat_file(p))
        except OSError as exc:
            if errors is None:
                raise
            errors[p] = exc
    run = HashRun({}, {s.path: s for s in stats}, files=len(stats), bytes=sum(s.size for s in stats))
    todo: list[FileStat] = []
    for st in stats:
        known = cache.get(st) if use_cache else None
        if known is None:
            todo.append(st)
        else:
            run.sha256[st.path] = known
    run.hashed_files = len(todo)
    run.hashed_bytes = sum(s.size for s in todo)
    if todo:
        _hash_todo(todo, run, cache, jobs or default_jobs(todo[0].real), progress, hasher, errors)
    cache.prune()
    cache.save()
    run.seconds = time.monotonic() - t0
    return run


def _hash_one(hasher: Hasher, st: FileStat, on_bytes, stop) -> str:
    """The digest of `st`, checked against a stat after the read: a file written to meanwhile
    raises `FileChanged` (its digest would be pinned with a size or mtime it does not belong to)."""
    try:
        digest = hasher(st.real, on_bytes, stop)
    except OSError as exc:
        if exc.filename == st.real:
            exc.filename = st.path  # the layout's name for it, not a symlink's target
        raise
    try:
        now = os.stat(st.real)
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror, st.path) from None
    if (now.st_size, now.st_mtime_ns, now.st_ino) != (st.size, st.mtime_ns, st.inode):
        raise FileChanged(errno.EAGAIN, "changed while it was being hashed (is something writing to it?)", st.path)
    return digest


def _hash_todo(
    todo: list[FileStat],
    run: HashRun,
    cache: HashCache,
    jobs: int,
    progress: HashProgress | None,
    hasher: Hasher,
    errors: dict[str, OSError] | None = None,
) -> None:
    stop = threading.Event()
    on_bytes = progress.advance if progress is not None else None
    if progress is not None:
        progress.start(len(todo), run.hashed_bytes)
    todo = sorted(todo, key=lambda s: -s.size)  # the big ones first: the pool ends together
    pool = ThreadPoolExecutor(max_workers=max(1, min(jobs, len(todo))), thread_name_prefix="molctl-hash")
    pending: dict[Future, FileStat] = {}
    last_save = time.monotonic()
    try:
        pending = {pool.submit(_hash_one, hasher, st, on_bytes, stop): st for st in todo}
        while pending:
            done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for fut in done:
                st = pending.pop(fut)
                try:
                    digest = fut.result()
                except OSError as exc:
                    if errors is None:
                        raise
                    errors[st.path] = exc
                    continue
                cache.put(st, digest)
                run.sha256[st.path] = digest
            if time.monotonic() - last_save >= SAVE_EVERY_S:
                cache.save()
                last_save = time.monotonic()
    except BaseException:
        stop.set()
        for fut in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        for fut, st in pending.items():  # files that finished while we were stopping still count
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                cache.put(st, fut.result())
        cache.save()
        raise
    finally:
        pool.shutdown(wait=True)
        if progress is not None:
            progress.close()
