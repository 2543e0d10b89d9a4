"""A bare vLLM (the CPU build) on the tiny profile for the benchmarks that measure the engine
without molctl's lifecycle: `start_vllm` launches it as `molctl up` would (the profile's argv and
environment, with overrides) in its own process group and waits for /health; `stop_group` stops
a process group, TERM then KILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from molctl.engines import get_engine  # noqa: E402
from molctl.lifecycle.launch import engine_env  # noqa: E402
from molctl.profiles import load_profile, profile_dirs  # noqa: E402
from tests.helpers import free_port  # noqa: E402


def start_vllm(
    model: Path, log: Path, overrides: list[tuple[str, object]], timeout: float = 600
) -> tuple[subprocess.Popen, str, object]:
    """(process, URL, profile) of a tiny-profile vLLM on a free port with `overrides` (profile
    paths and values, as `--set`), ready; one that exits or is not ready in time raises."""
    port = free_port()
    profile = load_profile("tiny", profile_dirs(), [("model_root", str(model)), ("engine.port", port), *overrides])
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            get_engine("vllm").launch_argv(profile),
            env=engine_env(profile),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("vLLM exited:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-60:]))
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return proc, url, profile
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"vLLM not ready in {timeout:.0f} s")
    except BaseException:
        stop_group(proc)
        raise


def stop_group(proc: subprocess.Popen, grace: float = 60) -> None:
    """SIGTERM to the process group, SIGKILL after `grace` seconds."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
