"""The compatibility suite's stack and runners: one fake engine (strict: it refuses what vLLM and
the Qwen3.5/3.6 templates refuse) and one tiny-profile proxy for the whole package, and each
client library run once per test module in its own environment (drivers.py), its results and the
engine's log of that run kept for the tests."""

from __future__ import annotations

import httpx
import pytest

from tests.clients.drivers import run_driver
from tests.helpers import free_ports
from tests.procs import fake_engine_argv, proxy_argv, running
from tests.proxy_stack import KEY, PUBLIC, STRICT


class ClientStack:
    def __init__(self, engine_url: str, proxy_url: str):
        self.engine_url, self.proxy_url = engine_url, proxy_url

    def log(self) -> list[dict]:
        return httpx.get(self.engine_url + "/_log").json()

    def reset(self) -> None:
        httpx.post(self.engine_url + "/_reset").raise_for_status()

    def run(self, argv: list[str]) -> tuple[dict, list[dict]]:
        """Run one client driver; -> (its per-case results, the engine's log of the run)."""
        self.reset()
        return run_driver(argv, self.proxy_url + "/v1", KEY, PUBLIC), self.log()


@pytest.fixture(scope="package")
def client_stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("client-logs")
    engine_port, proxy_port = free_ports(2)
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    keys = logs / "keys"
    keys.write_text(KEY)
    keys.chmod(0o600)
    with (
        running(fake_engine_argv(engine_port, STRICT), engine_url + "/health", log=logs / "engine.log"),
        running(
            proxy_argv("tiny", engine_url, proxy_port, "--api-key-file", str(keys)),
            proxy_url + "/health",
            log=logs / "proxy.log",
        ),
    ):
        yield ClientStack(engine_url, proxy_url)


@pytest.fixture(scope="module")
def runs(client_stack):
    """run(argv) -> (results, engine log) of that driver, run once per module."""
    cache: dict[tuple[str, ...], tuple[dict, list[dict]]] = {}

    def run(argv: list[str]) -> tuple[dict, list[dict]]:
        if tuple(argv) not in cache:
            cache[tuple(argv)] = client_stack.run(argv)
        return cache[tuple(argv)]

    return run
