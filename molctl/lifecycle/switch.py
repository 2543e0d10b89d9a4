"""`molctl switch`: drain and stop the running stack, then `up` the target profile, holding the
state lock throughout; a failed new stack names the command that brings the old one back. As soon
as the target's preflight passes, its shards are read into the page cache (molctl.prefetch) while
the old stack drains and the new engine imports: the warm switch."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from molctl import stackconfig
from molctl.errors import ExitStatus, MolctlError
from molctl.lifecycle.launch import UpOptions
from molctl.lifecycle.progress import Progress
from molctl.lifecycle.stacks import recorded_config, running_profiles
from molctl.lifecycle.start import _explicit_state_dir, _up_locked, already_running, preflight, resolve_key_option
from molctl.lifecycle.stop import down_locked
from molctl.lifecycle.stopsignals import interrupted_by
from molctl.processes import members
from molctl.state import StateLock, ensure_state_dir, read_records


def switch(name: str, ctx, opts: UpOptions, progress: Progress) -> dict[str, Any]:
    """Drain and stop whatever runs, then `up` the profile, holding the state lock throughout
    (no other `up` can start in between). The profile already running, ready, with this
    configuration is left alone (`up`'s already-running result). If the new profile fails its preflight (checked without
    the port category, since the old stack holds the ports), nothing is stopped. If the new stack
    fails after the old one was stopped, the error says so and names the command that brings the
    old one back."""
    from molctl.checks import validate_skip

    validate_skip(opts.skip)
    profile, config = stackconfig.load(name, ctx.dirs(), opts.overrides)
    key_args = resolve_key_option(opts)
    state_dir = ctx.state_dir
    ensure_state_dir(state_dir)
    with StateLock(state_dir, "switch", name):
        running = running_profiles(state_dir)
        same = already_running(profile, config, ctx, opts, key_args) if running == [name] else None
        if same is not None:  # never an hour's reload by a mistyped switch: `up`'s answer
            progress.step(f"profile {name} is already running and ready with this configuration; nothing to switch")
            return {**same, "stopped": []}
        # ports included: those the running stacks hold count as their own (own_profiles), a
        # stranger's fails the switch before the running stack is stopped
        preflight(profile, state_dir, opts, progress, "the running stack was left alone", own_profiles=running)
        warm = _start_prefetch(profile, opts, progress) if name not in running else None
        try:
            result, stopped, t_down = _replace(profile, config, ctx, opts, key_args, progress, running)
        finally:
            if warm is not None:
                warm.stop()  # the engine read what it needs: a prefetch still running stops here
                summary = warm.join(30.0).summary()
                for skipped in summary["skipped"]:
                    progress.step(f"prefetch: skipped {skipped['file']}: {skipped['reason']}")
    if warm is not None:
        result["prefetch"] = summary
    timings = result.get("timings", {})
    # total_s of a switch covers the whole switch: the old stack's stop plus the new one's start
    result["timings"] = {
        **timings,
        "stop_s": round(t_down, 2),
        "total_s": round(t_down + timings.get("total_s", 0.0), 2),
    }
    result["stopped"] = [s["profile"] for s in (stopped or {}).get("stopped", [])]
    return result


def _start_prefetch(profile, opts: UpOptions, progress: Progress):
    """The target's shards into the page cache while the running stack drains and the new engine
    imports (molctl.prefetch: bounded threads, only while memory allows); None with --no-prefetch."""
    if not getattr(opts, "prefetch", True):
        return None
    from molctl.prefetch import Prefetcher, model_files, total_size

    files = model_files(profile)
    warm = Prefetcher(files)
    size = total_size(files)  # a shard that cannot be read is the prefetch's skip, not the switch's error
    progress.step(
        f"prefetch: reading {len(files)} files ({size / 2**30:.1f} GiB) of {profile.name} into the page cache"
    )
    return warm.start()


def _replace(profile, config, ctx, opts: UpOptions, key_args, progress: Progress, running: list[str]):
    """Stop what runs, then `up` the profile: (up's result, down's result, seconds the stop took)."""
    state_dir, name = ctx.state_dir, profile.name
    back = {
        p: recorded_config(read_records(state_dir, p)).get("up_command") or f"molctl up {p}"
        for p in running
        if p != name
    }
    t0 = time.monotonic()
    try:
        stopped = (
            down_locked(state_dir, running, opts.drain_timeout_s, opts.stop_timeout_s, False, progress)
            if running
            else None
        )
    except (MolctlError, KeyboardInterrupt) as exc:
        how = _old_stacks(state_dir, back, _explicit_state_dir(ctx))
        if isinstance(exc, KeyboardInterrupt):
            raise MolctlError(
                f"interrupted{interrupted_by()} while stopping the old stack: {how}", ExitStatus.INTERRUPTED
            ) from None
        exc.args = (f"{exc}; {how}",)
        raise
    t_down = time.monotonic() - t0
    try:
        result = _up_locked(profile, config, ctx, opts, key_args, progress)
    except (MolctlError, OSError) as exc:
        if back:
            how = "; ".join(f"the old stack {p} was stopped: bring it back with `{cmd}`" for p, cmd in back.items())
            if isinstance(exc, OSError):  # a file the new stack needs (its log dir): exit 1, with the way back
                where = f": {exc.filename}" if exc.filename else ""
                raise MolctlError(f"{exc.strerror or exc}{where}; {how}") from None
            exc.args = (f"{exc}; {how}",)
        raise
    return result, stopped, t_down


def _old_stacks(state_dir: Path, back: dict[str, str], explicit_state_dir: Path | None) -> str:
    """What a switch interrupted while stopping the old stack(s) left: per stack, what still runs,
    and the commands that bring it back or finish the stop."""
    import shlex

    parts = []
    for name, cmd in back.items():
        running = [f"{c} (pid {r.pid})" for c, r in read_records(state_dir, name).items() if members(r)]
        if running:
            down = shlex.join(
                ["molctl", *(["--state-dir", str(explicit_state_dir)] if explicit_state_dir else []), "down", name]
            )
            parts.append(
                f"the old stack {name} is partly stopped (still running: {', '.join(running)}): bring it back "
                f"with `{cmd}` or finish stopping it with `{down}`"
            )
        else:
            parts.append(f"the old stack {name} was stopped: bring it back with `{cmd}`")
    return "; ".join(parts) or "nothing was running"
