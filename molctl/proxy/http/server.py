"""`molctl proxy`: run the proxy under uvicorn (uvloop + httptools) with drain-on-SIGTERM.

The first SIGTERM/SIGINT does not close the listener (uvicorn's default): the app starts
draining (/readyz 503, new requests 503 + Retry-After), in-flight requests finish, then the
summary hops of the turns they answered, all up to the drain deadline, then the server exits 0.
At the deadline the requests still running are answered by the app (503 `draining` naming the
request id; an error frame for a stream already started: ProxyApp.cut_requests) before the
server exits, so uvicorn's graceful-shutdown timer finds nothing left to cut (its plain-text 500).
A second signal exits at once. The summaries are waited for at most DRAIN_SUMMARIES_S (a hung
engine must not hold a `molctl down` for the summary hops' own 120 s timeouts)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from pathlib import Path

import uvicorn

import molctl.engines  # noqa: F401 - registers its profile checks (molctl.profilechecks), as the two below
import molctl.proxy.tracing  # noqa: F401
from molctl.proxy.http.app import ProxyApp, key_table
from molctl.proxy.http.protocol import HeadHoldingHttpToolsProtocol
from molctl.proxy.store.factory import open_stores

log = logging.getLogger("molctl.proxy")
DRAIN_SUMMARIES_S = 30.0  # a drain waits this long at most for the summary hops of answered turns
CUT_ANSWER_S = 2.0  # at the drain deadline: how long the 503 answers of the requests still running may take


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: ProxyApp, drain_timeout_s: float, key_file: Path | None = None):
        super().__init__(config)
        self.proxy_app = app
        self.drain_timeout_s = drain_timeout_s
        self.key_file = key_file
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reloading: asyncio.Future | None = None  # the SIGHUP reload in progress
        self._reload_again = False  # a SIGHUP arrived during it

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if threading.current_thread() is not threading.main_thread():
            return  # served in a thread (tests/proxy_in_process.py): no signals, as uvicorn's own handlers
        if self.key_file is not None:
            self._loop.add_signal_handler(signal.SIGHUP, self.reload_keys)
        else:
            self._loop.add_signal_handler(
                signal.SIGHUP, lambda: log.warning("SIGHUP: no key file to re-read; keys unchanged")
            )

    def reload_keys(self) -> None:
        """The SIGHUP handler (on the loop): the key file is read and hashed in a worker thread (a
        large one took seconds on the loop, every request waiting), then the keys are swapped on
        the loop. A burst of SIGHUPs is coalesced: one more read after the one in progress."""
        if self._reloading is not None and not self._reloading.done():
            self._reload_again = True
            return
        self._reloading = asyncio.ensure_future(self._reload_until_settled())

    async def _reload_until_settled(self) -> None:
        while True:
            self._reload_again = False
            try:
                table = await asyncio.to_thread(self._read_key_table)
            except Exception:  # noqa: BLE001 - never kill the loop's task; the old keys stay
                log.exception(
                    "SIGHUP: key file %s not reloaded; keeping the %d old key(s)",
                    self.key_file,
                    len(self.proxy_app.keys),
                )
                table = None
            if table is not None:
                self.proxy_app.keys = table
                log.info("SIGHUP: key file %s reloaded: %d key(s)", self.key_file, len(table))
            if not self._reload_again:
                return

    def _read_key_table(self) -> dict[bytes, str] | None:
        """In a worker thread: the new key table, or None (logged) when the file cannot be read,
        is not a regular file, is over the size bound or holds no key: the old keys stay."""
        import os
        import stat

        from molctl.keys import load_keys_settled

        try:
            if not stat.S_ISREG(os.stat(self.key_file).st_mode):  # a FIFO would block the reload for ever
                log.error(
                    "SIGHUP: key file %s is not a regular file; keeping the %d old key(s)",
                    self.key_file,
                    len(self.proxy_app.keys),
                )
                return None
            keys = load_keys_settled(self.key_file)  # not a file caught half-written
        except (OSError, UnicodeDecodeError) as exc:
            log.error(
                "SIGHUP: key file %s not reloaded (%s); keeping the %d old key(s)",
                self.key_file,
                getattr(exc, "strerror", None) or type(exc).__name__,
                len(self.proxy_app.keys),
            )
            return None
        if not keys:
            log.error(
                "SIGHUP: key file %s holds no key; keeping the %d old key(s)", self.key_file, len(self.proxy_app.keys)
            )
            return None
        return key_table(keys)

    def handle_exit(self, sig: int, frame) -> None:  # noqa: ARG002 - signal handler signature
        if self.proxy_app.draining or self._loop is None:
            self.should_exit = True
            if self.proxy_app.draining:
                self.force_exit = True
            return
        log.info("signal %s: draining (up to %.0f s)", signal.Signals(sig).name, self.drain_timeout_s)
        self.proxy_app.start_drain()
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        finished = await self.proxy_app.wait_idle(self.drain_timeout_s)
        if finished:  # then the summary hops of the turns just answered, within the same deadline
            finished = await self.proxy_app.wait_background(min(deadline - loop.time(), DRAIN_SUMMARIES_S))
        else:  # the deadline: what is still running is answered 503 draining by the app, not cut by uvicorn
            left = self.proxy_app.cut_requests()
            log.info("drain deadline reached: answering %d request(s) still running with 503 draining", left)
            await self.proxy_app.wait_idle(CUT_ANSWER_S)
        log.info("drain %s; exiting", "complete" if finished else "deadline reached")
        # let the last frames reach their clients before connections are closed
        await asyncio.sleep(0.05)
        self.should_exit = True


def proxy_server(
    app: ProxyApp, host: str, port: int, drain_timeout_s: float, key_file: Path | None = None
) -> DrainingServer:
    """The uvicorn server of `app` (uvloop, the head-holding httptools protocol, drain on a signal)."""

    def refused(status: int) -> None:  # a request head over the bound (molctl.proxy.http.protocol)
        app.counters.inc("requests_total", api="other", status=str(status), stream="false")

    http = HeadHoldingHttpToolsProtocol.configured(
        max_head_bytes=app.profile.proxy.max_request_head_bytes, on_refused=refused
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=http,
        lifespan="on",
        access_log=False,
        log_level="info",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=15,
    )
    return DrainingServer(config, app, drain_timeout_s, key_file)


def build_proxy(
    profile,
    engine_url: str,
    keys,
    state_dir: Path,
    listen_port: int,
    *,
    sse_keepalive_s: float,
    metrics: dict,
    replica_id: str | None = None,
    advertise_upstream: str | None = None,
):
    """The ProxyApp of `profile` in front of `engine_url` and the stores it serves from, (app,
    stores); the caller closes the stores. An unreachable Redis or a StoreError raises (one line)."""
    from molctl.engines import get_engine

    stores = open_stores(profile, state_dir, engine_url, listen_port, replica_id, advertise_upstream)
    try:
        extra = {"store": stores.conversations} if stores.conversations is not None else {}
        app = ProxyApp(
            profile,
            get_engine(profile.engine.kind),
            engine_url,
            keys,
            sse_keepalive_s=sse_keepalive_s,
            response_store=stores.responses,
            shared_state=stores.shared,
            **metrics,
            **extra,
        )
    except BaseException:
        stores.close()
        raise
    return app, stores


def run_proxy(
    name: str,
    ctx,
    overrides,
    *,
    upstream: str,
    host: str,
    port: int | None,
    api_key_file: Path | None,
    allow_unauthenticated: bool,
    drain_timeout: float,
    sse_keepalive: float | None,
    log_max_bytes: int | None = None,
    log_backups: int = 2,
    replica_id: str | None = None,
    advertise_upstream: str | None = None,
    metrics_port: int | None = None,
) -> None:
    """Load the profile (with the start's overrides), the keys and the log rotation; serve until
    a signal ends the drain. `ctx` gives dirs() (the CLI's Context)."""
    from molctl.keys import resolve_api_keys
    from molctl.profiles import load_profile

    overrides = list(overrides) + ([("proxy.metrics_port", metrics_port)] if metrics_port is not None else [])
    profile = load_profile(name, ctx.dirs(), overrides)  # checks metrics_port against the profile's ports
    if profile.proxy.metrics_port is not None and profile.proxy.metrics_port == port:
        from molctl.errors import UsageError

        raise UsageError(f"--metrics-port {profile.proxy.metrics_port} is also --port; they must differ")
    keys = resolve_api_keys(api_key_file, allow_unauthenticated)
    _configure_logging(log_max_bytes, log_backups)
    listen_port = port or profile.proxy.port
    public_socks, metrics = bind(profile, host, port, listen_port)
    keepalive = sse_keepalive or profile.proxy.sse_keepalive_s  # the option wins over the profile
    # unreachable Redis or a StoreError: one line, exit non-zero, nothing served
    app, stores = build_proxy(
        profile,
        upstream,
        keys,
        ctx.state_dir,
        listen_port,
        sse_keepalive_s=keepalive,
        metrics=metrics,
        replica_id=replica_id,
        advertise_upstream=advertise_upstream,
    )
    try:
        proxy_server(app, host, listen_port, drain_timeout, api_key_file).run(sockets=public_socks)
    finally:
        stores.close()


def _configure_logging(log_max_bytes: int | None, log_backups: int) -> None:
    """The log rotation, the line format (an engine's message quoted in a line: escaped), the request log."""
    if log_max_bytes:
        from molctl.logfiles import rotate_stdio

        rotate_stdio(log_max_bytes, log_backups)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from molctl.logfiles import EscapingFormatter

    for handler in logging.getLogger().handlers:  # an engine's message quoted in a line: escaped
        handler.setFormatter(EscapingFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    configure_request_log()


def bind(profile, host: str, port: int | None, listen_port: int) -> tuple[list[socket.socket], dict]:
    """The public listener, then the metrics one (each in use: one line, exit 4), and the app's metrics options."""
    from molctl.proxy.metrics import bind_listeners

    # the public port first, before the store is opened: in use is one line, exit 4 (not uvicorn's
    # log lines after the store of a running stack was opened)
    public_socks = bind_listeners(host, listen_port, "--host", "--port" if port else "proxy.port")
    metrics_sock = None
    if profile.proxy.metrics_port:
        from molctl.proxy.metrics import bind_metrics

        metrics_sock = bind_metrics(profile.proxy.metrics_host, profile.proxy.metrics_port)  # in use: exit 4
    metrics = {
        "metrics_port": profile.proxy.metrics_port,
        "metrics_host": profile.proxy.metrics_host,
        "metrics_sock": metrics_sock,
    }
    return public_socks, metrics


def configure_request_log() -> None:
    """The per-request JSON lines (logger molctl.proxy.requests) go to stderr as they are: one
    JSON object a line, no prefix, so they can be parsed line by line."""
    request_log = logging.getLogger("molctl.proxy.requests")
    if not request_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        request_log.addHandler(handler)
        request_log.propagate = False
        request_log.setLevel(logging.INFO)
