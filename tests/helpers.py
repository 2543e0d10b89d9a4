"""The tests' shared helpers: free ports, URLs, and the one way to run the CLI.

`Molctl` runs `molctl` as an operator would, with its own state dir and profile folders, and
returns a `CliResult` whose `exit_code` is an `ExitStatus` (assert by name: `ExitStatus.CONFLICT`,
not 4). It runs in-process (Typer's runner: fast, for check/profiles/demo) or as a subprocess
(for up/down/switch, whose components outlive the call and whose signals are real)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from molctl.errors import ExitStatus
from molctl.lifecycle.readiness import base_url

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int = 2) -> list[int]:
    """`n` distinct free ports (all bound at once, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(predicate, timeout: float = 15.0) -> bool:
    """Poll `predicate` every 50 ms until it is true or `timeout` s passed; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def url(port: int, host: str = "127.0.0.1") -> str:
    """`http://HOST:PORT`, built like molctl builds it (`molctl.lifecycle.readiness.base_url`)."""
    return base_url(host, port)


def exit_status(code: int) -> ExitStatus | int:
    """The documented exit status of a code (an undocumented one stays an int, and fails any
    comparison with an `ExitStatus` it is not)."""
    try:
        return ExitStatus(code)
    except ValueError:
        return code


def wait_status(proc: subprocess.Popen, timeout: float = 90) -> ExitStatus | int:
    """Wait for a `Molctl.start`ed command and return its exit status."""
    return exit_status(proc.wait(timeout))


@dataclass
class CliResult:
    exit_code: ExitStatus | int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


class Molctl:
    """The one CLI runner: `molctl --state-dir STATE [--profiles-dir DIR]... ARGS` (`state_dir`
    None: `molctl ARGS` exactly, e.g. a command molctl printed)."""

    def __init__(self, state_dir: Path | None, profiles_dirs: Iterable[Path] = (), in_process: bool = False):
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.profiles_dirs = [Path(d) for d in profiles_dirs]
        self.in_process = in_process

    def argv(self, *args: str) -> list[str]:
        out = ["--state-dir", str(self.state_dir)] if self.state_dir is not None else []
        for d in self.profiles_dirs:
            out += ["--profiles-dir", str(d)]
        return [*out, *args]

    def __call__(self, *args: str, env: dict | None = None, timeout: float = 90) -> CliResult:
        if self.in_process:
            from typer.testing import CliRunner

            from molctl.cli import app

            result = CliRunner().invoke(app, self.argv(*args), env=env, catch_exceptions=False)
            return CliResult(exit_status(result.exit_code), result.stdout, result.stderr)
        proc = subprocess.run(
            [sys.executable, "-m", "molctl", *self.argv(*args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env={**os.environ, "COLUMNS": "200", **(env or {})},
        )
        return CliResult(exit_status(proc.returncode), proc.stdout, proc.stderr)

    def start(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        """Run it in the background (its own session; the caller stops it: `tests.procs.stop`)."""
        return subprocess.Popen(
            [sys.executable, "-m", "molctl", *self.argv(*args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
