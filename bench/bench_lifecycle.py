"""Lifecycle speed against the fake engine (tests/fake_engine.py run through engine.python):
- from the engine answering /health to `molctl up` returning (proxy start included);
- `molctl status` on a running stack;
- `molctl switch` between two profiles, split into stop, engine start and molctl's own overhead.
Run with `make bench`."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from molctl.errors import ExitStatus  # noqa: E402
from molctl.profiles import builtin_profiles_dir  # noqa: E402
from tests.lifecycle_host import Host  # noqa: E402

STARTUP_DELAY = 2.0


def first_healthy(port: int, stop: threading.Event, out: dict) -> None:
    while not stop.is_set():
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.2).status_code == 200:
                out["t"] = time.monotonic()
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.005)


def timed_up(host: Host, profile: str, command: str = "up", port: int | None = None) -> tuple[float, float, dict]:
    stop, seen = threading.Event(), {}
    t = threading.Thread(target=first_healthy, args=(port or host.engine_port, stop, seen), daemon=True)
    t0 = time.monotonic()
    t.start()
    r = host.molctl(command, profile, *host.args("--json", env={"FAKE_STARTUP_DELAY": STARTUP_DELAY}, engine_port=port))
    t1 = time.monotonic()
    stop.set()
    assert r.exit_code == ExitStatus.OK, r.stderr
    return t1 - t0, t1 - seen["t"], json.loads(r.stdout)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        host = Host(Path(tmp))
        other = (builtin_profiles_dir() / "tiny.yaml").read_text().replace("name: tiny", "name: tiny-b")
        (host.profiles / "tiny-b.yaml").write_text(other)
        try:
            overheads = []
            for _ in range(3):
                total, after_ready, _ = timed_up(host, "tiny")
                overheads.append(after_ready)
                host.molctl("down")
            total, after_ready, _ = timed_up(host, "tiny")
            overheads.append(after_ready)
            status = []
            for _ in range(10):
                t0 = time.monotonic()
                assert host.molctl("status").exit_code == ExitStatus.OK
                status.append(time.monotonic() - t0)
            from tests.helpers import free_port

            total, after_ready, result = timed_up(host, "tiny-b", "switch", port=free_port())
            print(f"fake engine start-up delay {STARTUP_DELAY:.1f} s; medians")
            print(
                f"engine /health 200 -> `molctl up` returned: {statistics.median(overheads) * 1000:.0f} ms "
                f"(runs: {', '.join(f'{o * 1000:.0f}' for o in overheads)} ms; upstream polls every 5 s)"
            )
            print(f"`molctl status` on a running stack: {statistics.median(status) * 1000:.0f} ms")
            print(
                f"`molctl switch tiny-b`: {total:.2f} s in all = stop {result['timings']['stop_s']:.2f} s "
                f"+ engine start until /health 200 {total - after_ready - result['timings']['stop_s']:.2f} s "
                f"+ after ready {after_ready * 1000:.0f} ms"
            )
        finally:
            host.cleanup()
            subprocess.run(
                [sys.executable, "-m", "molctl", "--state-dir", str(host.state), "down", "--force"], capture_output=True
            )


if __name__ == "__main__":
    main()
