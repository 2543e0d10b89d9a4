"""uvicorn with the proxy's HTTP protocol and a small ASGI app, in a thread: `Server(app)` as a
context manager, its `port` free on 127.0.0.1. Used by the protocol, head-limit and rejected-traffic
tests (tests/proxy/http/)."""

from __future__ import annotations

import threading

import uvicorn

from molctl.proxy.http.protocol import HeadHoldingHttpToolsProtocol
from tests.helpers import free_port


class Server:
    """uvicorn with the proxy's protocol and a small ASGI app, in a thread."""

    def __init__(self, app, timeout_keep_alive: float = 5, http: type = HeadHoldingHttpToolsProtocol) -> None:
        self.port = free_port()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            http=http,
            lifespan="off",
            log_level="warning",
            loop="asyncio",
            timeout_keep_alive=timeout_keep_alive,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return self
            threading.Event().wait(0.02)
        raise TimeoutError("uvicorn did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
