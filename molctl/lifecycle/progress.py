"""What `up`, `down` and `switch` tell the operator while they work.

The lifecycle code only calls a `Progress`; the output layer implements it (`molctl.output.
ConsoleProgress`: plain lines, a spinner on a terminal, nothing but warnings with --json), and
tests pass anything with these methods."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def step(self, message: str) -> None:
        """One thing done or about to be done ("engine started (pid 123), log: ...")."""

    def warn(self, message: str) -> None:
        """Something the operator must know even with --json (a record kept, a process left alone)."""

    def waiting(self, elapsed: float, deadline: float, phase: str, detail: str, eta: str | None = None) -> None:
        """Still waiting for the engine: `phase` from its log (molctl.phases), `detail` from the last
        readiness probe, `eta` from this host's earlier starts (molctl.lifecycle.starthistory)."""

    def check_report(self, report) -> None:
        """The preflight failed: its failures and warnings."""

    def countdown(self, what: str, seconds_left: float) -> None:
        """`what` ignores SIGTERM so far: SIGKILL follows in `seconds_left`."""


class SilentProgress:
    """A `Progress` that says nothing (library callers, tests)."""

    def step(self, message: str) -> None:
        pass

    def warn(self, message: str) -> None:
        pass

    def waiting(self, elapsed: float, deadline: float, phase: str, detail: str, eta: str | None = None) -> None:
        pass

    def check_report(self, report) -> None:
        pass

    def countdown(self, what: str, seconds_left: float) -> None:
        pass
