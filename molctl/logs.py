"""`molctl logs`: the newest log file of each component, prefixed, optionally followed across
restarts (a restart opens a new timestamped log; following switches to it)."""

from __future__ import annotations

import time
from pathlib import Path

from molctl.errors import UsageError
from molctl.output import Output
from molctl.processes import tail
from molctl.state import COMPONENTS, newest_log


def _pick_profile(state_dir: Path, profile: str | None) -> str:
    if profile:
        return profile
    names = sorted(d.name for d in state_dir.iterdir() if (d / "logs").is_dir()) if state_dir.is_dir() else []
    if not names:
        raise UsageError(f"no stack logs in {state_dir} (start one with molctl up PROFILE)")
    if len(names) > 1:
        raise UsageError(f"logs of several profiles exist ({', '.join(names)}); name one: molctl logs PROFILE")
    return names[0]


def show_logs(ctx, profile: str | None, component: str | None, follow: bool, lines: int,
              out: Output | None = None, poll_s: float = 0.2, stop_after_s: float | None = None) -> None:
    out = out or Output()
    if component is not None and component not in COMPONENTS:
        raise UsageError(f"--component {component!r}: expected engine or proxy")
    name = _pick_profile(ctx.state_dir, profile)
    components = [component] if component else list(COMPONENTS)
    current: dict[str, tuple[Path, int]] = {}
    for comp in components:
        path = newest_log(ctx.state_dir, name, comp)
        if path is None:
            continue
        for line in tail(path, lines):
            out.raw(f"[{comp}] {line}\n")
        current[comp] = (path, path.stat().st_size)
    if not current and not follow:
        raise UsageError(f"no {component or 'engine or proxy'} log for profile {name} in {ctx.state_dir / name / 'logs'}")
    if not follow:
        return
    started = time.monotonic()
    partial: dict[str, str] = {}
    while stop_after_s is None or time.monotonic() - started < stop_after_s:
        for comp in components:
            newest = newest_log(ctx.state_dir, name, comp)
            if newest is None:
                continue
            path, pos = current.get(comp, (None, 0))
            if newest != path:
                if path is not None:
                    out.raw(f"[{comp}] ==> new log {newest} <==\n")
                path, pos = newest, 0
                partial[comp] = ""
            with open(path, "rb") as fh:
                fh.seek(pos)
                data = fh.read()
            if data:
                text = partial.get(comp, "") + data.decode(errors="replace")
                *complete, rest = text.split("\n")
                for line in complete:
                    out.raw(f"[{comp}] {line}\n")
                partial[comp] = rest
            current[comp] = (path, pos + len(data))
        time.sleep(poll_s)
