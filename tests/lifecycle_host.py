"""One test's host for the lifecycle tests (`Host`): a state dir, a tiny-shaped model layout, free
ports and a fake engine python; the `host` fixture (tests/conftest.py) hands out one per test and
cleans up after it. Also what several lifecycle test modules share: `EARLY_PROXY`, `gone`,
`add_tiny_b`, `answers`."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx

from molctl.profiles import builtin_profiles_dir
from molctl.state import read_records
from tests.helpers import CliResult, Molctl, free_ports
from tests.layouts import make_layout
from tests.procs import alive, fake_engine_python, stop

PUBLIC = "Macaron-Tiny-Demo"
# The proxy starts while the engine loads only without the adapter efficacy canary (with it, after
# the canary): the tests of a proxy running beside a loading engine start without it.
EARLY_PROXY = ("--skip", "adapter-effect")


class Host:
    """One test's host: a state dir, a tiny-shaped model layout, free ports, a fake engine python."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.state = tmp / "state"
        self.model = tmp / "model"
        make_layout(self.model, model_type="llama", shards=2, rank=8, base_name="tiny-mol-llama")
        self.python = fake_engine_python(tmp / "fake-python")
        self.engine_port, self.proxy_port = free_ports(2)
        self.profiles = tmp / "profiles"
        self.profiles.mkdir()
        self.cli = Molctl(self.state, [self.profiles])
        self.procs: list[subprocess.Popen] = []

    def args(self, *extra: str, env: dict | None = None, engine_port=None, proxy_port=None) -> list[str]:
        sets = [
            "--set",
            f"engine.python={self.python}",
            "--set",
            f"engine.port={engine_port or self.engine_port}",
            "--set",
            f"proxy.port={proxy_port or self.proxy_port}",
            "--model-root",
            str(self.model),
            "--skip",
            "engine",
            "--skip",
            "gpu",
            "--allow-unauthenticated",
            "--timeout",
            "30",
        ]
        for k, v in (env or {}).items():
            sets += ["--set", f"engine.env.{k}={v}"]
        return [*sets, *extra]

    def molctl(self, *args: str, timeout: float = 90, env: dict | None = None) -> CliResult:
        return self.cli(*args, timeout=timeout, env=env)

    def start(self, *args: str) -> subprocess.Popen:
        """A molctl in the background; stopped by `cleanup` if the test does not wait for it."""
        proc = self.cli.start(*args)
        self.procs.append(proc)
        return proc

    def up(self, *extra: str, env: dict | None = None, profile="tiny", **kw) -> CliResult:
        return self.molctl("up", profile, *self.args(*extra, env=env, **kw))

    def records(self, profile="tiny"):
        return read_records(self.state, profile)

    def stack_pids(self, profile="tiny") -> set[int]:
        from molctl.processes import members

        return {p.pid for r in self.records(profile).values() for p in members(r)}

    def cleanup(self):
        for proc in self.procs:
            stop(proc)
        if self.state.exists():
            self.molctl("down", "--stop-timeout", "2", "--drain-timeout", "2", "--force", timeout=60)


def port_free(port: int) -> bool:
    """No socket but TIME_WAIT leftovers on the port (see PortProbe.is_free)."""
    from molctl.probes import PortProbe

    return PortProbe().is_free("127.0.0.1", port)


def gone(pids, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def add_tiny_b(host: Host) -> None:
    """A second profile, `tiny-b`, beside the host's `tiny` (another served model name)."""
    other = (
        (builtin_profiles_dir() / "tiny.yaml")
        .read_text()
        .replace("name: tiny", "name: tiny-b")
        .replace("served_model_name: Macaron-Tiny-Demo", "served_model_name: Macaron-Tiny-B")
    )
    (host.profiles / "tiny-b.yaml").write_text(other)


def answers(url: str) -> bool:
    """True when `url` answers 200 within a second."""
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
