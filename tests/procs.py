"""Subprocess helpers for tests: every process a test starts is stopped by the test, even when
it fails (its own process group is killed), and servers listen on 127.0.0.1 on free ports."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from tests.helpers import ROOT

__all__ = [
    "ROOT",
    "FAKE_SGLANG_PKG",
    "fake_engine_argv",
    "fake_sglang_argv",
    "fake_engine_python",
    "proxy_argv",
    "running",
    "stop",
    "wait_http",
    "sglang_health_request_timeout",
    "alive",
]


def alive(pid: int) -> bool:
    """The process runs and is not a zombie. One psutil call that may find it gone: a
    `pid_exists(p) and Process(p)` pair races with the exit between the two (CI saw
    NoSuchProcess from exactly that)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# Readiness waits. A stand-in that answers at once gets READY_REQUEST_TIMEOUT_S per poll; the
# scripted SGLang's /health answers only after its documented generate (fake_sglang.py
# HEALTH_GENERATE_S, >= 1 s), so its polls wait that plus the same slack: a poll never races the
# answer it waits for, however loaded the machine. The overall deadline only bounds a failure.
READY_REQUEST_TIMEOUT_S = 5.0
READY_TIMEOUT_S = 60.0


def ready_deadline_s(base: float = READY_TIMEOUT_S) -> float:
    """`base` seconds, scaled by how loaded the machine is now (the 1-minute load average per
    core, at least 1): a start that takes 20 s on a quiet machine takes longer on a busy one."""
    return base * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def sglang_health_request_timeout() -> float:
    """The per-poll timeout for the scripted SGLang's /health: its documented generate time plus
    the slack every readiness poll gets."""
    from tests.fake_sglang import HEALTH_GENERATE_S

    return HEALTH_GENERATE_S + READY_REQUEST_TIMEOUT_S


def wait_http(
    url: str,
    timeout: float | None = None,
    status: int | None = 200,
    proc: subprocess.Popen | None = None,
    request_timeout: float = READY_REQUEST_TIMEOUT_S,
) -> None:
    """Poll `url` until it answers `status` (any status when None), each poll allowed
    `request_timeout` (what the server is documented to take, plus slack), within `timeout`
    (default: READY_TIMEOUT_S scaled by the machine's load, `ready_deadline_s`)."""
    timeout = ready_deadline_s() if timeout is None else timeout
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            r = httpx.get(url, timeout=max(0.1, min(request_timeout, deadline - time.monotonic())))
            if status is None or r.status_code == status:
                return
            last = r.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout} s (last: {last!r})")


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


@contextlib.contextmanager
def running(
    argv: list[str],
    ready_url: str | None = None,
    env: dict | None = None,
    log: Path | None = None,
    ready_status: int | None = 200,
    ready_request_timeout: float = READY_REQUEST_TIMEOUT_S,
):
    """Start `argv` in its own session; once `ready_url` answers `ready_status` (each poll allowed
    `ready_request_timeout`), yield it; stop its whole process group on the way out."""
    out = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
        cwd=ROOT,
    )
    try:
        if ready_url:
            wait_http(ready_url, status=ready_status, proc=proc, request_timeout=ready_request_timeout)
        yield proc
    finally:
        stop(proc)
        if log:
            out.close()


def fake_engine_argv(port: int, config: dict | None = None, scheduling_policy: str = "priority") -> list[str]:
    """The fake vLLM, started as the tiny profile starts vLLM (`--scheduling-policy priority`:
    the proxy's route hops carry a priority)."""
    import json

    return [
        sys.executable,
        str(ROOT / "tests" / "fake_engine.py"),
        "--port",
        str(port),
        "--config",
        json.dumps(config or {}),
        "--scheduling-policy",
        scheduling_policy,
    ]


def proxy_argv(profile: str, upstream: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "molctl", "proxy", profile, "--upstream", upstream, "--port", str(port), *extra]


FAKE_SGLANG_PKG = ROOT / "tests" / "fake_sglang_pkg"  # a fake `sglang` distribution (tests/fake_sglang.py)


def fake_sglang_argv(
    port: int,
    served: str,
    adapters_root: str = "/models/loras",
    config: dict | None = None,
    cache_report: bool = True,
    *extra: str,
) -> list[str]:
    """The fake SGLang launched as `python -m sglang.launch_server` would be, with L0-L3 loaded."""
    import json

    argv = [
        sys.executable,
        str(ROOT / "tests" / "fake_sglang.py"),
        "--model-path",
        "/models/base",
        "--served-model-name",
        served,
        "--port",
        str(port),
        "--config",
        json.dumps(config or {}),
    ]
    if cache_report:
        argv.append("--enable-cache-report")
    return [*argv, *extra, "--lora-paths", *(f"L{i}={adapters_root}/L{i}" for i in range(4))]


def fake_engine_python(path: Path) -> Path:
    """An `engine.python` for both fakes: `-m sglang.launch_server` (and `-c` probes) run the real
    interpreter with the fake sglang distribution on PYTHONPATH; anything else (a vLLM launch)
    runs tests/fake_engine.py."""
    path.write_text(
        f"#!/bin/sh\nPYTHONPATH={FAKE_SGLANG_PKG}; export PYTHONPATH\n"
        f'if [ "$1" = "-c" ] || [ "$2" = "sglang.launch_server" ]; then exec {sys.executable} "$@"; fi\n'
        f'exec {sys.executable} {ROOT / "tests" / "fake_engine.py"} "$@"\n'
    )
    path.chmod(0o755)
    return path
