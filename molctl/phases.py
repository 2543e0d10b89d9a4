"""The phases of a start, in order, and the clock that notes when each one began.

    config -> weights -> compile -> kv_cache -> cuda_graphs -> api_server -> canary -> proxy

The engine's phases come from its log: each engine module lists `(regex, phase, detail)`
patterns (`Engine.phases`, matched against what vLLM 0.32/0.24 and SGLang really log: the
patterns cite their lines); `canary` and `proxy` are molctl's own steps after the engine answers.
A phase the engine skips (no compile or CUDA graphs under `--enforce-eager`, on a CPU) is simply
absent. The log is read as it grows (new bytes only, `\\r` of progress bars counted as line ends),
so a phase that lasts less than one poll is still seen."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path

PHASES = ("config", "weights", "compile", "kv_cache", "cuda_graphs", "api_server", "canary", "proxy")
LABELS = {
    "config": "engine config",
    "weights": "loading weights",
    "compile": "torch.compile",
    "kv_cache": "KV cache",
    "cuda_graphs": "CUDA graphs",
    "api_server": "API server",
    "canary": "adapter canary",
    "proxy": "proxy",
}

Pattern = tuple[str, str, str]  # (regex, phase, detail: may use the regex groups, "{0}%")


def label(phase: str | None, detail: str = "") -> str:
    """`loading weights: 50% (1/2 shards)`: the phase's label and its detail."""
    if phase is None:
        return "starting"
    text = LABELS.get(phase, phase)
    return f"{text}: {detail}" if detail else text


def match_line(patterns: Iterable[Pattern], line: str) -> tuple[str, str] | None:
    """The phase and detail of one log line (the last matching pattern wins), or None."""
    found = None
    for regex, phase, detail in patterns:
        m = re.search(regex, line)
        if m:
            found = (phase, detail.format(*m.groups()))
    return found


def log_phase(patterns: Iterable[Pattern], lines: list[str]) -> tuple[str, str] | None:
    """The phase the newest matching line of `lines` names (what `top` shows of a loading engine)."""
    patterns = list(patterns)
    for line in reversed(lines):
        for part in reversed(line.split("\r")):
            found = match_line(patterns, part)
            if found:
                return found
    return None


# compile-cache lines: vllm/compilation/backends.py ("Directly load the compiled graph(s) for
# compile range ... from the cache" on a hit, "Compiling a graph for compile range ... takes" on a
# miss; both 0.24 and 0.32)
COMPILE_HIT = re.compile(r"Directly load the compiled graph")
COMPILE_MISS = re.compile(r"Compiling a graph for")


class PhaseClock:
    """When each phase of one start began (seconds since the clock started), from the engine's log
    (`feed_log`) and the starter's own steps (`enter`). Phases only move forward: a late line of
    an earlier phase (a warning printed again) does not move the start back."""

    def __init__(
        self, patterns: Iterable[Pattern], log_path: Path | str | None, clock: Callable[[], float] = time.monotonic
    ):
        self.patterns = list(patterns)
        self.log_path = Path(log_path) if log_path else None
        self.clock = clock
        self.t0 = clock()
        self.started: dict[str, float] = {}
        self.current: str | None = None
        self.detail = ""
        self.compile_cache: str | None = None  # "hit" | "miss" when the log says so
        self._offset = 0
        self._partial = ""
        self.enter("config")

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def enter(self, phase: str, detail: str = "") -> None:
        if self.current is not None and PHASES.index(phase) < PHASES.index(self.current):
            return
        if phase != self.current:
            self.started.setdefault(phase, round(self.elapsed(), 3))
            self.current = phase
        self.detail = detail

    def feed_log(self) -> None:
        """Read what the log gained since the last call; note the phases its lines name."""
        if self.log_path is None:
            return
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                data = f.read(4 << 20)
        except OSError:
            return
        self._offset += len(data)
        text = self._partial + data.decode("utf-8", "replace")
        *lines, self._partial = re.split(r"[\r\n]", text)
        for line in lines:
            self.feed_line(line)

    def feed_line(self, line: str) -> None:
        if self.compile_cache is None or self.compile_cache == "hit":
            if COMPILE_MISS.search(line):
                self.compile_cache = "miss"
            elif COMPILE_HIT.search(line) and self.compile_cache is None:
                self.compile_cache = "hit"
        found = match_line(self.patterns, line)
        if found:
            self.enter(*found)

    def label(self) -> str:
        return label(self.current, self.detail)

    def durations(self, end: float | None = None) -> dict[str, float]:
        """Each phase seen: its seconds, up to the next phase's start (the last one: up to `end`,
        default now)."""
        end = self.elapsed() if end is None else end
        order = sorted(self.started.items(), key=lambda kv: kv[1])
        out = {}
        for i, (phase, t) in enumerate(order):
            nxt = order[i + 1][1] if i + 1 < len(order) else end
            out[phase] = round(max(nxt - t, 0.0), 3)
        return out
