"""Proxy API keys: one key per line in a key file (blank lines and `#` comment lines ignored,
trailing newline optional), or one key in MOLCTL_API_KEY. Keys never travel on argv."""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

from molctl.errors import UsageError

# 64 MiB, about a million keys of 60 characters: a key file is never read whole whatever it is
# (/dev/zero, a runaway generator); the proxy re-reads it on SIGHUP in a worker thread
MAX_KEY_FILE_BYTES = 64 << 20


def _read_bounded(path, regular_only: bool = False) -> bytes:
    """At most MAX_KEY_FILE_BYTES of `path` (more is an OSError). `regular_only` (a reload): the
    file is opened without blocking and the opened file itself must be regular, so a FIFO put in
    its place after any check by name cannot block the read for ever."""
    if regular_only:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "is not a regular file")
        fh = os.fdopen(fd, "rb")
    else:
        fh = open(path, "rb")
    with fh:
        data = fh.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise OSError(errno.EFBIG, f"larger than {MAX_KEY_FILE_BYTES} bytes (expected one key per line)")
    return data


def _parse_keys(data: bytes) -> list[str]:
    lines = [line.strip() for line in data.decode("utf-8-sig").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def load_keys(path) -> list[str]:
    """The keys of a key file; a UTF-8 BOM (a Windows editor's) is not part of the first key, and a
    line starting with `#` (a header config management writes) is a comment, not a key.
    A file larger than MAX_KEY_FILE_BYTES (or a device such as /dev/zero) is an OSError, read no
    further: a key file is never read into memory whole, nor for seconds on the proxy's event loop."""
    return _parse_keys(_read_bounded(path))


def load_keys_settled(path, pause_s: float = 0.05, limit_s: float = 2.0) -> list[str]:
    """`load_keys` for a reload (SIGHUP), which may come while the file is being rewritten in place
    (`cat > keys`, a script writing line by line): the file is read until two reads `pause_s` apart
    agree, so a half-written file is not taken for the new key set (a key cut in two would lock its
    tenant out). A file still changing after `limit_s` is an OSError (EBUSY): the old keys stay.
    Each read checks the opened file is regular (an OSError otherwise, never a blocked read).
    Blocks for at least `pause_s`: call it from a worker thread. Writing the new file beside the old
    one and renaming it over it (what editors and config management do) never needs this."""
    deadline = time.monotonic() + limit_s
    data = _read_bounded(path, regular_only=True)
    while True:
        time.sleep(pause_s)
        again = _read_bounded(path, regular_only=True)
        if again == data:
            return _parse_keys(data)
        if time.monotonic() > deadline:
            raise OSError(
                errno.EBUSY,
                f"still changing after {limit_s:g} s (write the new file beside it, then rename it over it)",
            )
        data = again


def resolve_api_keys(api_key_file: Path | None, allow_unauthenticated: bool) -> list[str] | None:
    """The accepted keys, or None for an explicitly unauthenticated proxy; exit 2 otherwise."""
    if api_key_file is not None:
        try:
            keys = load_keys(api_key_file)
        except OSError as exc:
            raise UsageError(f"--api-key-file {api_key_file}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise UsageError(
                f"--api-key-file {api_key_file}: not UTF-8 text (byte {exc.start}); expected one key per line"
            ) from None
        if not keys:
            raise UsageError(f"--api-key-file {api_key_file} holds no key (expected one key per line)")
        return keys
    env_key = os.environ.get("MOLCTL_API_KEY", "").strip()
    if env_key:
        return [env_key]
    if allow_unauthenticated:
        return None
    raise UsageError("no API key for the proxy: give --api-key-file F (or MOLCTL_API_KEY), or --allow-unauthenticated")
