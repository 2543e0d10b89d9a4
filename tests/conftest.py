from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from molctl.cli import app


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


@pytest.fixture(autouse=True)
def host_lock_dir(tmp_path_factory, monkeypatch) -> Path:
    """Host-wide port/GPU claims in a private folder per test (inherited by every molctl a test runs)."""
    d = tmp_path_factory.mktemp("locks")
    monkeypatch.setenv("MOLCTL_LOCK_DIR", str(d))
    return d


@pytest.fixture
def state_dir(tmp_path) -> Path:
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def molctl(state_dir, monkeypatch):
    """Run the CLI in-process, with a private state dir and no profile dirs from the environment."""
    monkeypatch.delenv("MOLCTL_PROFILES_DIR", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    runner = CliRunner()

    def run(*args: str, env: dict | None = None) -> CliResult:
        result = runner.invoke(app, ["--state-dir", str(state_dir), *args], env=env, catch_exceptions=False)
        return CliResult(result.exit_code, result.stdout, result.stderr)

    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_ports():
    """Two distinct free ports (engine, proxy)."""
    socks = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports
