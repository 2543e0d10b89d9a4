"""This host's earlier starts of a profile (STATE/PROFILE/starts.json) and the ETA they give.

After each start that ends ready, `up` appends `{host, at, total_s, phases: {phase: seconds},
engine, cache}`; the file keeps the newest `KEEP` starts (all hosts together: a state dir on a
shared filesystem holds several) and is replaced atomically (temp file + rename), so a crash
leaves the old history, never half of a new one. A history that cannot be read is treated as none
(it is only an estimate), and the next successful start rewrites it; so is a start whose total is
not a duration, and a phase whose value is not one.

The ETA of a start is the median total of this host's last `WINDOW` starts of the profile (the
median: one start after a reboot with a cold page cache does not move it much). While the start
runs, the time left is that total less the time spent, but never less than what the phases after
the current one took before (a start that runs late still has its later phases ahead)."""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from molctl.phases import PHASES

FILE = "starts.json"
KEEP = 50
WINDOW = 5


def history_path(state_dir: Path, profile: str) -> Path:
    return Path(state_dir) / profile / FILE


def host_name() -> str:
    return socket.gethostname()


def load(state_dir: Path, profile: str) -> list[dict]:
    """Every recorded start (oldest first); [] when there is none or the file is unreadable."""
    return _read(state_dir, profile)[0]


def _read(state_dir: Path, profile: str) -> tuple[list[dict], str | None]:
    """The recorded starts, and why the file could not be used (None: it could, or there is none)."""
    path = history_path(state_dir, profile)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return [], None
    except OSError as exc:
        return [], f"{path} cannot be read: {exc.strerror or exc}"
    except ValueError:
        return [], f"{path} is not valid JSON"
    starts = data.get("starts") if isinstance(data, dict) else None
    if not isinstance(starts, list):
        return [], f"{path} holds no list of starts"
    return [_clean(s) for s in starts if isinstance(s, dict) and _seconds(s.get("total_s"))], None


def _seconds(value) -> bool:
    """A duration as `up` writes it: a finite, non-negative number (not a boolean)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _clean(start: dict) -> dict:
    """`start` with only the phases whose value is a duration (a file edited by hand or by another
    tool may hold anything: the estimate takes what it can use and ignores the rest)."""
    phases = start.get("phases")
    phases = {p: s for p, s in phases.items() if _seconds(s)} if isinstance(phases, dict) else {}
    return {**start, "phases": phases}


def append(state_dir: Path, profile: str, entry: dict, keep: int = KEEP) -> None:
    """Add one start (bounded to the newest `keep`), atomically."""
    path = history_path(state_dir, profile)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    starts = [*load(state_dir, profile), entry][-keep:]
    tmp = path.with_name(f".{FILE}.{host_name()}.{os.getpid()}.tmp")  # two hosts on one shared state dir
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"version": 1, "starts": starts}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def entry(total_s: float, phases: dict[str, float], engine: str, cache: str | None, host: str | None = None) -> dict:
    """One start: `cache` "warm"/"empty" (the engine cache before it; None: unknown)."""
    return {
        "host": host or host_name(),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "total_s": round(total_s, 2),
        "phases": phases,
        "engine": engine,
        "cache": cache,
    }


@dataclass
class Estimate:
    """What this host's earlier starts say about the next one; `starts` 0: no history."""

    starts: int = 0
    total_s: float | None = None
    phase_s: dict[str, float] = field(default_factory=dict)  # median seconds per phase
    unreadable: str | None = None  # why the history could not be used (the next start rewrites it)

    def remaining(self, elapsed: float, phase: str | None) -> float | None:
        """Seconds left, `elapsed` seconds into a start now in `phase`; None without history."""
        if self.total_s is None:
            return None
        left = self.total_s - elapsed
        if phase in PHASES:
            later = sum(s for p, s in self.phase_s.items() if p in PHASES and PHASES.index(p) > PHASES.index(phase))
            left = max(left, later)
        return max(left, 0.0)

    def summary(self) -> dict:
        """The `eta` object of `up --json`, `switch --json` and `status --json`."""
        return {
            "history_starts": self.starts,
            "expected_total_s": None if self.total_s is None else round(self.total_s, 1),
            "phases_s": {p: round(s, 1) for p, s in self.phase_s.items()},
            "basis": f"median of this host's last {self.starts} start(s)" if self.starts else self._no_history(),
        }

    def _no_history(self) -> str:
        if self.unreadable:
            return f"no usable history: {self.unreadable} (the next start that ends ready rewrites it)"
        return "no earlier start"


def estimate(state_dir: Path, profile: str, host: str | None = None) -> Estimate:
    host = host or host_name()
    starts, unreadable = _read(state_dir, profile)
    mine = [s for s in starts if s.get("host") == host][-WINDOW:]
    if not mine:
        return Estimate(unreadable=unreadable)
    phase_s: dict[str, float] = {}
    for phase in PHASES:
        seen = [s["phases"][phase] for s in mine if isinstance(s.get("phases"), dict) and phase in s["phases"]]
        if seen:
            phase_s[phase] = statistics.median(seen)
    return Estimate(
        starts=len(mine),
        total_s=statistics.median(s["total_s"] for s in mine),
        phase_s=phase_s,
    )


def eta_text(est: Estimate, elapsed: float, phase: str | None) -> str:
    """`ETA 35 s (median of 3 starts)` or `no ETA yet: first start of this profile on this host`."""
    left = est.remaining(elapsed, phase)
    if left is None and est.unreadable:
        return f"no ETA: {est.unreadable}"
    if left is None:
        return "no ETA yet: first start of this profile on this host"
    return f"ETA {left:.0f} s (median of {est.starts} earlier start{'s' if est.starts != 1 else ''})"
