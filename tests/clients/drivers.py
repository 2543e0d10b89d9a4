"""How to run one client driver (py_clients.py under .venv-clients, js/clients.mjs under node with
js/node_modules, both made by `make clients`, part of `make test`) and read its results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CLIENTS_PYTHON = ROOT / ".venv-clients" / "bin" / "python"
CLIENTS_JS = HERE / "js"


def python_client_argv(client: str) -> list[str]:
    assert CLIENTS_PYTHON.exists(), f"{CLIENTS_PYTHON} is missing: `make clients` (part of `make test`) makes it"
    return [str(CLIENTS_PYTHON), str(HERE / "py_clients.py"), client]


def js_client_argv(client: str) -> list[str]:
    node = shutil.which("node")
    assert node, "node is not on PATH: the JavaScript clients (tests/clients/js) need Node.js and npm"
    stamp = CLIENTS_JS / "node_modules" / ".stamp"
    assert stamp.exists(), f"{stamp} is missing: `make clients` (part of `make test`) runs npm ci there"
    return [node, str(CLIENTS_JS / "clients.mjs"), client]


def run_driver(argv: list[str], base_url: str, key: str, model: str, timeout: float = 240, **env: str) -> dict:
    """Run one driver against `base_url` (the proxy's /v1) -> its per-case results."""
    env = {
        **os.environ,
        "MOL_BASE_URL": base_url,
        "MOL_KEY": key,
        "MOL_MODEL": model,
        "NO_PROXY": "127.0.0.1,localhost",
        "OPENAI_API_KEY": key,
        **env,
    }
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"{argv[1]} exited {proc.returncode}: {proc.stderr[-3000:]}"
    return json.loads(lines[-1])
