"""Where the shared store is and how to reach it from outside the event loop: `proxy.store`'s
URL (`parse_redis_url`: redis[s]://[user@]host[:port][/db], never a password), the password
(`read_password`: proxy.store_password_file or $MOLCTL_STORE_PASSWORD, never argv), a blocking
client for start-up and the CLI (`ping_sync`), and the errors: `RedisConfigError` (one line
naming proxy.store), `StoreUnavailable` (a 503 with Retry-After for requests that need state)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from molctl.errors import MolctlError
from molctl.profilespec import ProxySpec, default_of
from molctl.proxy import fastjson
from molctl.proxy.errors import ProxyError

PASSWORD_ENV = "MOLCTL_STORE_PASSWORD"
CALL_TIMEOUT_S = default_of(ProxySpec, "store_call_timeout_s")  # one store call, round trip included
CONNECT_TIMEOUT_S = 1.0
RETRY_AFTER_S = "2"


class StoreUnavailable(ProxyError):
    """The shared store cannot be reached: a 503 with Retry-After for requests that need state."""

    def __init__(self, why: str = ""):
        super().__init__(
            503,
            "The proxy's state store is unavailable; retry shortly.",
            "server_error",
            "store_unavailable",
            headers={"retry-after": RETRY_AFTER_S},
        )
        self.why = why


class RedisConfigError(MolctlError):
    """proxy.store names Redis but cannot be used (one line naming proxy.store)."""


@dataclass(frozen=True)
class RedisTarget:
    url: str  # as given (never holds a password)
    host: str
    port: int
    db: int
    tls: bool
    username: str | None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal, as in a URL
        return f"{'rediss' if self.tls else 'redis'}://{host}:{self.port}/{self.db}"


def is_redis_spec(spec: str) -> bool:
    return spec.startswith(("redis://", "rediss://"))


def parse_redis_url(spec: str) -> RedisTarget:
    """ValueError (one line, what was expected) for anything but redis[s]://[user@]host[:port][/db]
    (port 1-65535, db an ASCII number; an explicit port 0 is refused, not read as the default)."""
    expected = "expected redis://host:port/db or rediss://host:port/db"
    try:
        parts = urlsplit(spec)
        parts.hostname  # noqa: B018 - raises ValueError for a malformed IPv6 literal ("[::1")
    except ValueError as exc:
        shown = spec.split("://", 1)[0]  # never the rest: it may hold a user part (a mistyped password)
        raise ValueError(f"{shown}://...: {exc} ({expected})") from None
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"{spec!r}: {expected}")
    if parts.password is not None:
        raise ValueError(
            "the URL holds a password: put it in proxy.store_password_file or the environment "
            f"variable {PASSWORD_ENV}, never in the URL"
        )
    if not parts.hostname:
        raise ValueError(f"{parts.scheme}://...: no host (expected {parts.scheme}://host:port/db)")
    host_port = parts.netloc.rpartition("@")[2]  # never the user part in a message: it may be a mistyped password
    try:
        port = 6379 if parts.port is None else parts.port
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise ValueError(f"{parts.scheme}://{host_port}: the port is not a number from 1 to 65535")
    path = parts.path.strip("/")
    if path and not (path.isascii() and path.isdigit()):
        raise ValueError(f"{parts.scheme}://{parts.hostname}:{port}/{path}: the database must be a number (e.g. /0)")
    if parts.query or parts.fragment:
        raise ValueError(f"{parts.scheme}://{parts.hostname}:{port}/{path}: no query or fragment expected")
    return RedisTarget(
        spec,
        parts.hostname,
        port,
        int(path or 0),
        parts.scheme == "rediss",
        unquote(parts.username) if parts.username else None,
    )


def read_password(password_file: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The store password: proxy.store_password_file (first line), else $MOLCTL_STORE_PASSWORD, else None."""
    env = os.environ if environ is None else environ
    if password_file:
        try:
            text = Path(password_file).expanduser().read_text()
        except OSError as exc:
            raise RedisConfigError(
                f"proxy.store_password_file {password_file}: cannot read it ({exc.strerror or exc})"
            ) from None
        first = text.strip().splitlines()[0].strip() if text.strip() else ""
        if not first:
            raise RedisConfigError(
                f"proxy.store_password_file {password_file}: empty (expected the password on its first line)"
            )
        return first
    return env.get(PASSWORD_ENV) or None


def _client_kwargs(target: RedisTarget, password: str | None) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "host": target.host,
        "port": target.port,
        "db": target.db,
        "username": target.username,
        "password": password,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": CALL_TIMEOUT_S,
        "decode_responses": False,
        "health_check_interval": 0,
    }
    if target.tls:
        kw["ssl"] = True
    return kw


def _sync_client(target: RedisTarget, password: str | None, timeout_s: float = 2.0):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw = _client_kwargs(target, password)
    kw.update(socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    return redis.Redis(**kw)


def ping_sync(target: RedisTarget, password: str | None, timeout_s: float = 2.0) -> str | None:
    """None when Redis answers PING within timeout_s, else why not (one line). For start-up and
    `molctl check` (a plain blocking client: nothing else runs then)."""
    import redis

    client = _sync_client(target, password, timeout_s)
    try:
        client.ping()
        return None
    except redis.RedisError as exc:
        return _why(exc, password)
    finally:
        client.close()


def _why(exc: BaseException, password: str | None) -> str:
    """Why a store call from outside the proxy failed (one line). A server that wants a password
    while none is configured says so (redis-py's own words there are about HELLO)."""
    import redis

    if isinstance(exc, redis.AuthenticationError) or "NOAUTH" in str(exc):
        if password is None:
            return (
                f"the server requires a password and none is configured (proxy.store_password_file or {PASSWORD_ENV})"
            )
        return f"authentication failed ({exc}); the password comes from proxy.store_password_file or {PASSWORD_ENV}"
    return str(exc) or type(exc).__name__


def unreachable_error(target: RedisTarget, why: str) -> RedisConfigError:
    return RedisConfigError(f"proxy.store {target.address}: unreachable: {why}")


def _decode(raw: bytes, **fields: type | tuple[type, ...]) -> dict[str, Any] | None:
    """A stored JSON object whose `fields` have these types, else None: an unreadable value (written
    by another molctl version, a hand edit, another program) is treated as absent, never a crash."""
    try:
        data = fastjson.loads(raw)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return None
    if not isinstance(data, dict) or any(not isinstance(data.get(k), t) for k, t in fields.items()):
        return None
    return data
