"""`python -m molctl.lifecycle.waitready`: block until a stack component serves (the `ExecStartPost=` of
the systemd units `molctl render systemd` writes).

    python -m molctl.lifecycle.waitready [--profiles-dir DIR]... engine PROFILE --timeout S [--set-json JSON]
            [--state-dir DIR]
        PROFILE's engine is ready as `up` decides it (molctl.lifecycle.readiness.EngineReadiness: /health,
        L0-L3 under the right parent, the version where the engine reports it, a 1-token
        completion per adapter), polled at its `engine.host`/`engine.port`. With --state-dir, it
        says the ETA from this host's earlier starts (molctl.lifecycle.starthistory) when it begins and
        every 30 s while it waits (with the last poll's detail: the unit's log is the journal's,
        not a file molctl reads phases from), and records the start's total when it ends ready.
    python -m molctl.lifecycle.waitready url URL --timeout S
        URL answers 200 (the proxy's /readyz).

Exit 0 ready, 6 timed out, 7 adapters missing or misattached, 3 version mismatch or a bad
profile, 2 usage; one line on stderr says why.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import molctl.engines  # noqa: F401 - these three register their profile checks (molctl.profilechecks)
import molctl.proxy.store.factory  # noqa: F401
import molctl.proxy.tracing  # noqa: F401
from molctl.errors import ExitStatus, MolctlError
from molctl.lifecycle.readiness import Poll, http_status, wait_ready


class _UrlReadiness:
    def __init__(self, url: str, status: Callable[[str], int | None] = http_status):
        self.url, self.status = url, status

    def poll(self) -> Poll:
        code = self.status(self.url)
        return (
            Poll("ready", f"{self.url} answered 200")
            if code == 200
            else Poll("down", f"{self.url} answered {code}" if code else f"{self.url} is not answering")
        )


def _engine_readiness(profile_name: str, profiles_dirs: list[Path], set_json: str | None):
    from molctl import stackconfig
    from molctl.engines import get_engine
    from molctl.lifecycle.launch import engine_upstream
    from molctl.lifecycle.readiness import EngineReadiness
    from molctl.profiles import profile_dirs

    overrides = [(k, v) for k, v in json.loads(set_json)] if set_json else []
    profile, _ = stackconfig.load(profile_name, profile_dirs(profiles_dirs), overrides)
    return EngineReadiness(profile, get_engine(profile.engine.kind), url=engine_upstream(profile))


class _History:
    """The ETA of a unit's start from this host's earlier starts of the profile, and its record."""

    EVERY_S = 30.0

    def __init__(self, state_dir: Path, profile: str):
        from molctl.lifecycle import starthistory

        self.state_dir, self.profile = state_dir, profile
        self.estimate = starthistory.estimate(state_dir, profile)
        self.last = 0.0
        print(
            f"molctl.lifecycle.waitready: engine {profile}: {starthistory.eta_text(self.estimate, 0.0, None)}",
            file=sys.stderr,
        )

    def on_wait(self, elapsed: float, probe: Poll) -> None:
        from molctl.lifecycle.starthistory import eta_text

        if elapsed - self.last >= self.EVERY_S:
            self.last = elapsed
            text = eta_text(self.estimate, elapsed, None)
            print(
                f"molctl.lifecycle.waitready: engine starting, {elapsed:.0f} s ({probe.detail}); {text}",
                file=sys.stderr,
            )

    def record(self, elapsed: float, engine: str) -> None:
        from molctl.lifecycle import starthistory

        try:
            starthistory.append(self.state_dir, self.profile, starthistory.entry(elapsed, {}, engine, None))
        except OSError as exc:  # only the next ETA lacks it
            where = starthistory.history_path(self.state_dir, self.profile)
            print(
                f"molctl.lifecycle.waitready: could not record the start in {where}: {exc.strerror or exc}",
                file=sys.stderr,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m molctl.lifecycle.waitready", description=__doc__.splitlines()[0])
    parser.add_argument("--profiles-dir", action="append", default=[], type=Path)
    sub = parser.add_subparsers(dest="what", required=True)
    eng = sub.add_parser("engine")
    eng.add_argument("profile")
    eng.add_argument("--set-json", default=None)
    eng.add_argument("--state-dir", default=None, type=Path)
    url = sub.add_parser("url")
    url.add_argument("url")
    for p in (eng, url):
        p.add_argument("--timeout", type=float, required=True)
    args = parser.parse_args(argv)
    try:
        readiness = (
            _engine_readiness(args.profile, args.profiles_dir, args.set_json)
            if args.what == "engine"
            else _UrlReadiness(args.url)
        )
        history = _History(args.state_dir, args.profile) if args.what == "engine" and args.state_dir else None
        probe, elapsed = wait_ready(
            readiness,
            args.timeout,
            check_alive=lambda: None,
            on_wait=history.on_wait if history else lambda *_: None,
            clock=time.monotonic,
            poll_s=1.0,
        )
    except MolctlError as exc:
        print(f"molctl.lifecycle.waitready: {exc}", file=sys.stderr)
        return int(exc.exit_status)
    except ValueError as exc:  # a malformed --set-json
        print(f"molctl.lifecycle.waitready: --set-json: {exc}", file=sys.stderr)
        return int(ExitStatus.USAGE)
    if probe.state == "ready":
        print(f"molctl.lifecycle.waitready: {args.what} ready after {elapsed:.0f} s ({probe.detail})", file=sys.stderr)
        if history is not None:
            history.record(elapsed, readiness.profile.engine.kind)
        return 0
    status = {"adapters": ExitStatus.ADAPTERS, "version": ExitStatus.CHECK_FAILED}.get(probe.state, ExitStatus.TIMEOUT)
    print(f"molctl.lifecycle.waitready: {args.what} not ready after {elapsed:.0f} s: {probe.detail}", file=sys.stderr)
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
