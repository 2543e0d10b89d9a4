"""Proxy API keys: one key per line in a key file (blank lines and `#` comment lines ignored,
trailing newline optional), or one key in MOLCTL_API_KEY. Keys never travel on argv."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from molctl.errors import UsageError

# 64 MiB, about a million keys of 60 characters: a key file is never read whole whatever it is
# (/dev/zero, a runaway generator); the proxy re-reads it on SIGHUP in a worker thread
MAX_KEY_FILE_BYTES = 64 << 20


def load_keys(path) -> list[str]:
    """The keys of a key file; a UTF-8 BOM (a Windows editor's) is not part of the first key, and a
    line starting with `#` (a header config management writes) is a comment, not a key.
    A file larger than MAX_KEY_FILE_BYTES (or a device such as /dev/zero) is an OSError, read no
    further: a key file is never read into memory whole, nor for seconds on the proxy's event loop."""
    with open(path, "rb") as fh:
        data = fh.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise OSError(errno.EFBIG, f"larger than {MAX_KEY_FILE_BYTES} bytes (expected one key per line)")
    lines = [line.strip() for line in data.decode("utf-8-sig").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def resolve_api_keys(api_key_file: Path | None, allow_unauthenticated: bool) -> list[str] | None:
    """The accepted keys, or None for an explicitly unauthenticated proxy; exit 2 otherwise."""
    if api_key_file is not None:
        try:
            keys = load_keys(api_key_file)
        except OSError as exc:
            raise UsageError(f"--api-key-file {api_key_file}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise UsageError(f"--api-key-file {api_key_file}: not UTF-8 text (byte {exc.start}); "
                             "expected one key per line") from None
        if not keys:
            raise UsageError(f"--api-key-file {api_key_file} holds no key (expected one key per line)")
        return keys
    env_key = os.environ.get("MOLCTL_API_KEY", "").strip()
    if env_key:
        return [env_key]
    if allow_unauthenticated:
        return None
    raise UsageError("no API key for the proxy: give --api-key-file F (or MOLCTL_API_KEY), or --allow-unauthenticated")
