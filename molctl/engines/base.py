"""What every engine adapter provides, and the shared pieces of launch-argv rendering."""

from __future__ import annotations

import abc
import json
import subprocess
from dataclasses import dataclass, field
from typing import Any, Mapping

from molctl.profiles import ROUTES, Profile


@dataclass
class EngineInstall:
    """What the engine's own interpreter reports about the installed engine package."""

    found: bool
    version: str | None = None
    flags: frozenset[str] = field(default_factory=frozenset)
    error: str | None = None


def render_args(args: Mapping[str, Any]) -> list[str]:
    """`{"max-model-len": 2048, "enable-lora": true, "off": false}` -> `--max-model-len 2048 --enable-lora`."""
    argv: list[str] = []
    for flag, value in args.items():
        if value is False or value is None:
            continue
        argv.append(f"--{flag}")
        if value is True:
            continue
        if isinstance(value, list):
            argv.extend(str(v) for v in value)
        else:
            argv.append(str(value))
    return argv


def run_probe_script(python: str, script: str, *args: str, timeout: float = 120) -> EngineInstall:
    """Run `script` under the engine's interpreter; it prints one JSON object on its last line."""
    try:
        proc = subprocess.run([python, "-c", script, *args], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return EngineInstall(found=False, error=f"engine.python {python!r} does not exist")
    except PermissionError:
        return EngineInstall(found=False, error=f"engine.python {python!r} is not executable")
    except subprocess.TimeoutExpired:
        return EngineInstall(found=False, error=f"{python} did not answer within {timeout:.0f} s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return EngineInstall(found=False, error=f"{python} failed (exit {proc.returncode}): {tail}")
    data = json.loads(lines[-1])
    return EngineInstall(found=data.get("found", False), version=data.get("version"),
                         flags=frozenset(data.get("flags", ())), error=data.get("error"))


class Engine(abc.ABC):
    """Base class; subclasses fill in the engine-specific parts."""

    kind: str = ""
    package: str = ""  # the import name of the engine package
    memory_flag: str = ""  # the flag that sets the fraction of GPU memory the engine takes
    # (regex, label) pairs read from the engine's log to show the start-up phase; the last
    # matching line wins; a label may use the regex groups ("{0}/{1}").
    phases: tuple[tuple[str, str], ...] = ()

    @abc.abstractmethod
    def launch_argv(self, profile: Profile) -> list[str]:
        """See the engine modules."""

    @abc.abstractmethod
    def probe_install(self, python: str) -> EngineInstall:
        """See the engine modules."""

    @abc.abstractmethod
    def guided_choice(self, labels: list[str]) -> dict[str, Any]:
        """Request fields that constrain the route hop's output to one of `labels`."""

    @abc.abstractmethod
    def adapter_model(self, profile: Profile, route: str) -> str:
        """The `model` field that selects an adapter in a request to the engine."""

    # Shared helpers -----------------------------------------------------------------------
    def profile_flags(self, profile: Profile) -> list[str]:
        """Every flag the launch argv passes, without dashes (for the flag-acceptance check)."""
        return [a[2:] for a in self.launch_argv(profile) if a.startswith("--")]

    def memory_fraction(self, profile: Profile) -> float | None:
        value = profile.engine.args.get(self.memory_flag)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def max_lora_rank(self, profile: Profile) -> int | None:
        value = profile.engine.args.get("max-lora-rank")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def phase(self, log_lines: list[str]) -> str | None:
        import re

        for line in reversed(log_lines):
            for pattern, label in reversed(self.phases):
                m = re.search(pattern, line)
                if m:
                    return label.format(*m.groups())
        return None

    def adapter_pairs(self, profile: Profile) -> list[str]:
        return [f"{route}={profile.adapter_dir(route)}" for route in ROUTES]
