"""The lifecycle commands: `up`, `switch`, `down`, `status`, `reload`, `logs`, `top`, `prefetch`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from molctl.cli.base import (
    DRAIN_OPT,
    FULL_HASH_OPT,
    JSON_OPT,
    KEY_FILE_OPT,
    MANIFEST_OPT,
    MODEL_ROOT_OPT,
    SET_OPT,
    SKIP_OPT,
    STOP_OPT,
    TIMEOUT_OPT,
    UNAUTH_OPT,
    _verify_options,
    handle_errors,
    overrides_from,
)
from molctl.errors import ExitStatus, MolctlError


def _up_options(
    ctx,
    model_root,
    set_,
    skip,
    timeout,
    api_key_file,
    allow_unauthenticated,
    drain_timeout,
    stop_timeout=60.0,
    restart=False,
):
    from molctl.lifecycle.launch import UpOptions

    return UpOptions(
        overrides=overrides_from(model_root, set_),
        skip=skip,
        timeout_s=timeout,
        api_key_file=api_key_file,
        allow_unauthenticated=allow_unauthenticated,
        drain_timeout_s=drain_timeout,
        profiles_dirs=list(ctx.obj.profiles_dirs),
        stop_timeout_s=stop_timeout,
        restart=restart,
    )


def _run_start(profile: str, json_: bool, call) -> None:
    from molctl.lifecycle.starter import StartFailed
    from molctl.lifecycle.stopsignals import interrupt_on_stop_signals
    from molctl.output import ConsoleProgress, Output

    out = Output(as_json=json_)
    progress = ConsoleProgress(out)
    interrupt_on_stop_signals()  # SIGTERM and SIGHUP clean up as Ctrl-C does
    try:
        result = call(progress)
    except MolctlError as exc:
        progress.close()
        out.start_failure(profile, exc)
        if isinstance(exc, StartFailed) or json_:
            if exc.exit_status == ExitStatus.INTERRUPTED:
                from molctl.lifecycle.stopsignals import ignore_stop_signals

                ignore_stop_signals()  # a late Ctrl-C must not cut the report
            out.error(str(exc))
            raise typer.Exit(int(exc.exit_status)) from None
        raise
    progress.close()
    out.up_result(result)


@handle_errors
def up_cmd(
    ctx: typer.Context,
    profile: str = typer.Argument(..., help="Profile to start."),
    model_root: Optional[Path] = MODEL_ROOT_OPT,
    set_: List[str] = SET_OPT,
    skip: List[str] = SKIP_OPT,
    timeout: Optional[float] = TIMEOUT_OPT,
    api_key_file: Optional[Path] = KEY_FILE_OPT,
    allow_unauthenticated: bool = UNAUTH_OPT,
    drain_timeout: float = DRAIN_OPT,
    stop_timeout: float = STOP_OPT,
    restart: bool = typer.Option(
        False,
        "--restart",
        help="Stop this profile's running stack first (drain, then stop), e.g. to run it with another configuration.",
    ),
    verify: bool = typer.Option(
        False,
        "--verify",
        help="Refuse to start unless the host matches a `molctl lock` manifest (the `lock` category in the preflight).",
    ),
    manifest: Optional[Path] = MANIFEST_OPT,
    full_hash: bool = FULL_HASH_OPT,
    json_: bool = JSON_OPT,
) -> None:
    """Check, start the engine, wait until it really serves L0-L3, start the proxy. Idempotent."""
    from molctl.lifecycle.start import up

    opts = _up_options(
        ctx, model_root, set_, skip, timeout, api_key_file, allow_unauthenticated, drain_timeout, stop_timeout, restart
    )
    opts.verify = _verify_options(verify, manifest, full_hash)
    _run_start(profile, json_, lambda progress: up(profile, ctx.obj, opts, progress))


@handle_errors
def switch_cmd(
    ctx: typer.Context,
    profile: str = typer.Argument(..., help="Profile to run instead of the current one."),
    model_root: Optional[Path] = MODEL_ROOT_OPT,
    set_: List[str] = SET_OPT,
    skip: List[str] = SKIP_OPT,
    timeout: Optional[float] = TIMEOUT_OPT,
    api_key_file: Optional[Path] = KEY_FILE_OPT,
    allow_unauthenticated: bool = UNAUTH_OPT,
    drain_timeout: float = DRAIN_OPT,
    stop_timeout: float = STOP_OPT,
    no_prefetch: bool = typer.Option(
        False,
        "--no-prefetch",
        help="Do not read PROFILE's shards into the page cache while the running stack drains.",
    ),
    json_: bool = JSON_OPT,
) -> None:
    """Drain and stop whatever stack runs, then `up PROFILE`. A failing preflight stops nothing."""
    from molctl.lifecycle.switch import switch

    opts = _up_options(
        ctx, model_root, set_, skip, timeout, api_key_file, allow_unauthenticated, drain_timeout, stop_timeout
    )
    opts.prefetch = not no_prefetch
    _run_start(profile, json_, lambda progress: switch(profile, ctx.obj, opts, progress))


@handle_errors
def down_cmd(
    ctx: typer.Context,
    profile: Optional[str] = typer.Argument(None, help="Profile to stop (default: every recorded stack)."),
    drain_timeout: float = DRAIN_OPT,
    stop_timeout: float = STOP_OPT,
    force: bool = typer.Option(
        False,
        "--force",
        help="Remove records even when processes could not be verified gone; "
        "stop the processes an unreadable record's marker names.",
    ),
    json_: bool = JSON_OPT,
) -> None:
    """Proxy first (drain), then the engine group (SIGTERM, then SIGKILL); verify nothing survives."""
    from molctl.lifecycle.stop import down
    from molctl.output import ConsoleProgress, Output

    out = Output(as_json=json_)
    progress = ConsoleProgress(out)
    try:
        result = down(ctx.obj, profile, drain_timeout, force, progress, engine_timeout_s=stop_timeout)
    finally:
        progress.close()
    out.down_result(result)


@handle_errors
def status_cmd(
    ctx: typer.Context,
    profile: Optional[str] = typer.Argument(None, help="Profile (default: every recorded stack)."),
    json_: bool = JSON_OPT,
) -> None:
    """Recorded stacks, probed live: processes, ports, /health, /readyz, uptime, logs, GPU memory."""
    from molctl.lifecycle.status import status
    from molctl.output import Output

    Output(as_json=json_).status(status(ctx.obj, profile))


@handle_errors
def reload_cmd(
    ctx: typer.Context,
    profile: str = typer.Argument(..., help="Profile whose running proxy re-reads its API key file."),
    json_: bool = JSON_OPT,
) -> None:
    """Make the running proxy re-read its API key file (SIGHUP), without dropping connections."""
    from molctl.lifecycle.reload import reload
    from molctl.output import Output

    result = reload(ctx.obj, profile)
    if json_:
        Output(as_json=True).json(result)  # indent 2, as every --json (docs/contract.md, section 3)
    else:
        typer.echo(
            f"{profile}: sent SIGHUP to the proxy (pid {result['pid']}); it re-reads its key file "
            f"(molctl logs {profile} --component proxy shows the outcome)"
        )


@handle_errors
def logs_cmd(
    ctx: typer.Context,
    profile: Optional[str] = typer.Argument(None, help="Profile (default: the running stack, else the newest logs)."),
    component: Optional[str] = typer.Option(None, "--component", help="engine or proxy (default: both)."),
    follow: bool = typer.Option(
        False, "-f", "--follow", help="Keep printing new lines, across restarts and rotations."
    ),
    lines: int = typer.Option(
        50, "-n", "--lines", help="Lines to print from the end of each log (0: none, e.g. with -f)."
    ),
) -> None:
    """The last lines of the newest log of each component, prefixed; -f follows them."""
    from molctl.logs import show_logs

    try:
        show_logs(ctx.obj, profile, component, follow, lines)
    except KeyboardInterrupt:  # the way to end -f: quietly
        raise typer.Exit(int(ExitStatus.INTERRUPTED)) from None
    except BrokenPipeError:  # `molctl logs | head`: the reader has what it wanted; quietly, exit 0
        _drop_stdout()


@handle_errors
def top_cmd(
    ctx: typer.Context,
    profile: Optional[str] = typer.Argument(None, help="Profile (default: the running stack)."),
    once: bool = typer.Option(False, "--once", help="Print one frame (figures since the proxy started) and exit."),
    json_: bool = JSON_OPT,
) -> None:
    """A live view of the running stack, refreshed each second (q or Ctrl-C quits): state, load phase,
    requests/s, p50/p95 per hop, TTFT, adapter mix, cache hit ratio, admission, summaries."""
    from molctl.output import Output
    from molctl.top import run

    try:
        run(ctx.obj, profile, once, json_, Output(as_json=json_))
    except KeyboardInterrupt:  # a way to end the live view: quietly
        raise typer.Exit(int(ExitStatus.INTERRUPTED)) from None


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush into a closed pipe does
    not print an error of its own."""
    import os
    import sys

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


@handle_errors
def prefetch_cmd(
    ctx: typer.Context,
    profile: str = typer.Argument(..., help="Profile whose shards to read into the page cache."),
    model_root: Optional[Path] = MODEL_ROOT_OPT,
    set_: List[str] = SET_OPT,
    threads: int = typer.Option(4, "--threads", min=1, max=64, help="Files read at once."),
    json_: bool = JSON_OPT,
) -> None:
    """Read PROFILE's safetensors shards into the page cache (only while free memory allows), so its next start loads from memory."""
    from molctl.output import Output
    from molctl.prefetch import prefetch_profile
    from molctl.profiles import load_profile

    prof = load_profile(profile, ctx.obj.dirs(), overrides_from(model_root, set_))
    Output(as_json=json_).prefetch_result(profile, prefetch_profile(prof, threads=threads).summary())
