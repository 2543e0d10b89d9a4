"""The proxy in the test's own process: `proxy_in_process(...)` builds the ProxyApp and its uvicorn
server with the code `molctl proxy` runs (molctl.proxy.http.server: bind, build_proxy,
proxy_server) and serves it on a thread of its own, on a free 127.0.0.1 port, until the block
ends. Clients reach it over real HTTP as they reach `molctl proxy`; the test can also reach the
app itself (`InProcessProxy.app`: its counters, its stores, its deadlines).

What it leaves out is what needs a process of its own, and is tested with one (tests/procs.py
`proxy_argv`): signals (drain on SIGTERM, SIGHUP key reload), log files and their rotation, the
exit status, and the CLI's option parsing. A start costs no interpreter and no imports (about
0.45 CPU-s a `molctl proxy` process on the CI machine)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from molctl.keys import load_keys
from molctl.profiles import load_profile, profile_dirs
from molctl.profileyaml import parse_set_option
from molctl.proxy.http.server import bind, build_proxy, proxy_server
from tests.helpers import free_port
from tests.procs import wait_http

STOP_WITHIN_S = 10.0  # uvicorn's own graceful shutdown is 5 s (proxy_server's timeout_graceful_shutdown)


def _log_handlers(log: Path) -> list[tuple[str, logging.Handler]]:
    """What `molctl proxy` writes to its log, appended to `log`: the molctl and uvicorn loggers'
    lines in the proxy's format, the request log's JSON lines as they are (one object a line)."""
    lines = logging.FileHandler(log)
    lines.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    lines.addFilter(lambda record: record.name != "molctl.proxy.requests")
    requests = logging.FileHandler(log)
    requests.setFormatter(logging.Formatter("%(message)s"))
    return [("molctl", lines), ("uvicorn.error", lines), ("molctl.proxy.requests", requests)]


def own_records(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    """The records logged on the calling thread. An in-process proxy logs into this process's
    logging tree from its own thread, so `caplog` also holds a module stack's lines (a late
    summary's warning, another test's request line) beside those of an app the test runs itself."""
    me = threading.get_ident()
    return [r for r in records if r.thread == me]


def _close(socks, metrics: dict) -> None:
    """The listeners `bind` opened: the public ones and the metrics one."""
    for sock in [*socks, metrics.get("metrics_sock")]:
        if sock is not None:
            sock.close()


class _Thread:
    """The serving thread as `wait_http` watches a process: it ended (startup failed) -> an exit status."""

    def __init__(self, thread: threading.Thread):
        self.thread = thread
        self.returncode = None

    def poll(self) -> int | None:
        self.returncode = None if self.thread.is_alive() else 1
        return self.returncode


@dataclass
class InProcessProxy:
    url: str
    app: object  # molctl.proxy.http.app.ProxyApp
    server: object  # its molctl.proxy.http.server.DrainingServer

    def settle(self, timeout: float = 30.0) -> None:
        """Wait, on the proxy's own loop, until every request it admitted has finished and the
        summary hops they started have ended: what a test waited a guessed time for before
        checking what the proxy did (or did not do) after its answer."""

        async def settled() -> bool:
            if not await self.app.wait_idle(timeout):
                return False
            tasks = list(self.app.orch.background)
            return not tasks or not (await asyncio.wait(tasks, timeout=timeout))[1]

        if not asyncio.run_coroutine_threadsafe(settled(), self.server._loop).result(2 * timeout + 5):
            raise TimeoutError(f"the in-process proxy at {self.url} still worked after {timeout} s")


@contextlib.contextmanager
def proxy_in_process(
    profile_name: str,
    engine_url: str,
    state_dir: Path,
    *,
    key_file: Path | None = None,
    sets: tuple[str, ...] = (),
    metrics_port: int | None = None,
    log: Path | None = None,
):
    """`molctl proxy PROFILE --upstream ENGINE_URL [--api-key-file F] [--set K=V ...]
    [--metrics-port N]` served in this process; yields an InProcessProxy once /health answers.
    `log`: the proxy's log records (the molctl loggers, the request log) are appended there too."""
    overrides = [parse_set_option(s) for s in sets]
    if metrics_port is not None:
        overrides.append(("proxy.metrics_port", metrics_port))
    profile = load_profile(profile_name, profile_dirs(), overrides)
    keys = load_keys(key_file) if key_file is not None else None
    port = free_port()
    socks, metrics = bind(profile, "127.0.0.1", port, port)
    try:
        app, stores = build_proxy(
            profile, engine_url, keys, state_dir, port, sse_keepalive_s=profile.proxy.sse_keepalive_s, metrics=metrics
        )
    except BaseException:
        _close(socks, metrics)
        raise
    server = proxy_server(app, "127.0.0.1", port, drain_timeout_s=STOP_WITHIN_S, key_file=key_file)
    handlers = _log_handlers(log) if log is not None else []
    levels = {name: logging.getLogger(name).level for name, _ in handlers}
    for name, handler in handlers:
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)  # as `molctl proxy` logs (logging.basicConfig INFO)
    thread = threading.Thread(target=server.run, kwargs={"sockets": socks}, name=f"proxy-{port}", daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc=_Thread(thread))
        yield InProcessProxy(url, app, server)
    finally:
        server.should_exit = True
        thread.join(STOP_WITHIN_S)
        _close(socks, metrics)
        stores.close()
        for name, handler in handlers:
            logging.getLogger(name).removeHandler(handler)
            logging.getLogger(name).setLevel(levels[name])
            handler.close()
        if thread.is_alive():
            raise RuntimeError(f"the in-process proxy on port {port} did not stop within {STOP_WITHIN_S} s")
