"""`molctl prefetch PROFILE` and the warm `switch`: read a profile's safetensors shards into the
page cache before its engine loads them, so the load reads memory instead of the disk.

A few threads read whole files in large blocks (`threads`, default 4: enough to keep an NVMe or a
network filesystem busy without starving the running stack of I/O). Memory comes first: a file
is read only while the host's available memory (psutil's `available`: what can be given without
swapping) stays above the file's size plus a margin (`margin_bytes`: the larger of 4 GiB and 10%
of the host's memory), checked again before every block; a file that does not fit is skipped and
the reason said. The page cache a prefetch fills is counted as used, although the kernel could
reclaim it: the point is never to push the running stack (its own page cache, its processes)
into reclaim. The memory probe and the file reader are injected (tests run anywhere).

vLLM has its own prefetch (`--safetensors-load-strategy prefetch`, vllm/config/load.py, in 0.24's
parser; vLLM 0.32 turns it on by itself on NFS/Lustre when the checkpoint fits in 90% of the
RAM): molctl's runs earlier, while the old stack drains and the new engine imports, and for any
engine."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from molctl.errors import ExitStatus, MolctlError
from molctl.routes import ROUTES

WAKE_S = 0.2  # how often the main thread wakes while the readers run: Ctrl-C is handled within it

BLOCK = 16 << 20
GIB = 1 << 30


def default_available() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def default_margin() -> int:
    import psutil

    return max(4 * GIB, int(psutil.virtual_memory().total * 0.10))


def read_blocks(path: Path, block: int, keep_going: Callable[[], bool]) -> int:
    """Read `path` sequentially in `block`-sized pieces while `keep_going()`; returns the bytes read."""
    done = 0
    buf = bytearray(block)
    with open(path, "rb", buffering=0) as f:
        while keep_going():
            n = f.readinto(buf)
            if not n:
                break
            done += n
    return done


def model_files(profile) -> list[Path]:
    """The files the engine reads to load `profile`: the base's shards, then the adapters'."""
    files = sorted(profile.base_dir.glob("*.safetensors"))
    for route in ROUTES:
        files += sorted(profile.adapter_dir(route).glob("*.safetensors"))
    return files


@dataclass
class Prefetch:
    """One prefetch's outcome (`summary()` is the JSON of `molctl prefetch` and `switch`)."""

    files: int = 0
    bytes_total: int = 0
    bytes_read: int = 0
    read: list[str] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"file", "reason"}
    seconds: float = 0.0
    stopped: bool = False  # stop() was called before it finished

    def summary(self) -> dict:
        return {
            "files": self.files,
            "files_read": len(self.read),
            "bytes_total": self.bytes_total,
            "bytes_read": self.bytes_read,
            "skipped": self.skipped,
            "seconds": round(self.seconds, 2),
            "stopped": self.stopped,
        }


class Prefetcher:
    """Reads `files` into the page cache on `threads` threads (run() blocks; start() runs it in
    the background and stop()/join() end it)."""

    def __init__(
        self,
        files: list[Path],
        *,
        threads: int = 4,
        margin_bytes: int | None = None,
        available: Callable[[], int] = default_available,
        reader: Callable[[Path, int, Callable[[], bool]], int] = read_blocks,
        block: int = BLOCK,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.files, self.threads, self.block = list(files), max(1, threads), block
        self.margin = default_margin() if margin_bytes is None else margin_bytes
        self.available, self.reader, self.clock = available, reader, clock
        self.result = Prefetch(files=len(self.files))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _fits(self, size: int) -> bool:
        return self.available() - size >= self.margin

    def _one(self, path: Path) -> None:
        if self._stop.is_set():
            return
        try:
            st = path.stat()
        except OSError as exc:
            self._skip(path, f"cannot stat: {exc.strerror or exc}")
            return
        if not stat.S_ISREG(st.st_mode):  # a FIFO blocks open() for good, /dev/zero never ends
            self._skip(path, f"{_kind(st.st_mode)}, not a regular file")
            return
        size = st.st_size
        if not self._fits(size):
            self._skip(path, self._memory_reason(size))
            return
        short = []

        def keep_going() -> bool:
            if self._stop.is_set():
                return False
            if not self._fits(self.block):
                short.append(self._memory_reason(self.block))
                return False
            return True

        try:
            n = self.reader(path, self.block, keep_going)
        except OSError as exc:
            self._skip(path, f"read failed: {exc.strerror or exc}")
            return
        with self._lock:
            self.result.bytes_read += n
            if short:
                self.result.skipped.append({"file": str(path), "reason": f"stopped after {n} bytes: {short[0]}"})
            elif not self._stop.is_set():
                self.result.read.append(str(path))

    def _memory_reason(self, size: int) -> str:
        avail = self.available()
        return (
            f"available memory {avail / GIB:.1f} GiB less {size / GIB:.1f} GiB would fall below the margin "
            f"of {self.margin / GIB:.1f} GiB (the running stack keeps its memory)"
        )

    def _skip(self, path: Path, reason: str) -> None:
        with self._lock:
            self.result.skipped.append({"file": str(path), "reason": reason})

    def run(self) -> Prefetch:
        t0 = self.clock()
        self.result.bytes_total = total_size(self.files)
        pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="molctl-prefetch")
        try:
            pending = {pool.submit(self._one, path) for path in self.files}
            while pending:
                # a timed wait: Python runs a signal's handler (Ctrl-C) in the main thread between
                # bytecodes; a SIGINT that lands just before an untimed wait blocks would be handled
                # only when the file being read ends (a minute in a test, longer for a big shard)
                done, pending = wait(pending, timeout=WAKE_S, return_when=FIRST_EXCEPTION)
                for future in done:
                    future.result()  # a reader's unexpected error, raised here
        except BaseException:  # Ctrl-C: the readers stop after their current block, the rest never starts
            self._stop.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        self.result.seconds = self.clock() - t0
        self.result.stopped = self._stop.is_set()
        return self.result

    def start(self) -> Prefetcher:
        self._thread = threading.Thread(target=self.run, name="molctl-prefetch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> Prefetch:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.result


def total_size(files: list[Path]) -> int:
    """The bytes of the regular files among `files` (one that cannot be read counts 0: the
    prefetch skips it and says why)."""
    total = 0
    for path in files:
        try:
            st = path.stat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


def prefetch_profile(profile, threads: int = 4, **kw) -> Prefetch:
    """`molctl prefetch PROFILE`: the profile's files into the page cache, now. A model root
    without the base's shards is an error (exit 3): a mistyped --model-root would otherwise
    "read 0 of 0 files" and look like success."""
    base = profile.base_dir
    if not base.is_dir() or not any(base.glob("*.safetensors")):
        what = "is not a directory" if not base.is_dir() else "holds no *.safetensors shard"
        raise MolctlError(
            f"model root {profile.model_root}: {base} {what} (expected the base model's shards; "
            "set model_root or --model-root)",
            ExitStatus.CHECK_FAILED,
        )
    return Prefetcher(model_files(profile), threads=threads, **kw).run()


def drop_from_cache(path: Path) -> None:
    """Evict `path`'s pages from the page cache (written back first: POSIX_FADV_DONTNEED drops only
    clean pages; no root needed): the bench's cold start without `echo 1 > /proc/sys/vm/drop_caches`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
