"""The compatibility suite's stack and runners: one fake engine (strict: it refuses what vLLM and
the Qwen3.5/3.6 templates refuse) and one tiny-profile proxy for the whole package, and each
client library run once per test module in its own environment (Python clients under
.venv-clients, JavaScript clients under tests/clients/js/node_modules, both made by `make clients`,
part of `make test`), its results and the engine's log of that run kept for the tests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_ports
from tests.procs import fake_engine_argv, proxy_argv, running
from tests.test_proxy import KEY, PUBLIC, STRICT

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CLIENTS_PYTHON = ROOT / ".venv-clients" / "bin" / "python"
CLIENTS_JS = HERE / "js"


class ClientStack:
    def __init__(self, engine_url: str, proxy_url: str):
        self.engine_url, self.proxy_url = engine_url, proxy_url

    def log(self) -> list[dict]:
        return httpx.get(self.engine_url + "/_log").json()

    def reset(self) -> None:
        httpx.post(self.engine_url + "/_reset").raise_for_status()

    def run(self, argv: list[str], timeout: float = 240) -> tuple[dict, list[dict]]:
        """Run one client driver; -> (its per-case results, the engine's log of the run)."""
        self.reset()
        env = {**os.environ, "MOL_BASE_URL": self.proxy_url + "/v1", "MOL_KEY": KEY, "MOL_MODEL": PUBLIC,
               "NO_PROXY": "127.0.0.1,localhost", "OPENAI_API_KEY": KEY}
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        assert proc.returncode == 0 and lines, f"{argv[-1]} exited {proc.returncode}: {proc.stderr[-3000:]}"
        return json.loads(lines[-1]), self.log()


@pytest.fixture(scope="package")
def client_stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("client-logs")
    engine_port, proxy_port = free_ports(2)
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    keys = logs / "keys"
    keys.write_text(KEY)
    keys.chmod(0o600)
    with running(fake_engine_argv(engine_port, STRICT), engine_url + "/health", log=logs / "engine.log"), \
            running(proxy_argv("tiny", engine_url, proxy_port, "--api-key-file", str(keys)), proxy_url + "/health",
                    log=logs / "proxy.log"):
        yield ClientStack(engine_url, proxy_url)


def python_client_argv(client: str) -> list[str]:
    assert CLIENTS_PYTHON.exists(), f"{CLIENTS_PYTHON} is missing: `make clients` (part of `make test`) makes it"
    return [str(CLIENTS_PYTHON), str(HERE / "py_clients.py"), client]


def js_client_argv(client: str) -> list[str]:
    node = shutil.which("node")
    assert node, "node is not on PATH: the JavaScript clients (tests/clients/js) need Node.js and npm"
    stamp = CLIENTS_JS / "node_modules" / ".stamp"
    assert stamp.exists(), f"{stamp} is missing: `make clients` (part of `make test`) runs npm ci there"
    return [node, str(CLIENTS_JS / "clients.mjs"), client]
