"""The command line: the `molctl` app, its global options and the registration of the commands,
which live in this package's modules by command group (check, lifecycle, demo, bench, proxy,
render; base: the shared Context, errors and options), as the hf CLI's app only registers. A
command parses options, calls the module that does the work and hands its result to an
`molctl.output.Output` method. No logic and no rendering live here.

Exit codes are `molctl.errors.ExitStatus`; every `MolctlError` becomes one line on stderr. The
contract (commands, exit codes, JSON shapes) is in docs/contract.md."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from molctl import __version__
from molctl.cli.base import JSON_OPT, Context, handle_errors
from molctl.cli.bench import bench_cmd
from molctl.cli.check import check_cmd, lock_cmd
from molctl.cli.demo import demo_app
from molctl.cli.lifecycle import (
    down_cmd,
    logs_cmd,
    prefetch_cmd,
    reload_cmd,
    status_cmd,
    switch_cmd,
    top_cmd,
    up_cmd,
)
from molctl.cli.proxy import proxy_cmd, state_app
from molctl.cli.render import render_app
from molctl.errors import ExitStatus

EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 1 unexpected error; 2 usage error; 3 a check or the profile failed; "
    "4 conflict (port or GPU claimed by another stack, another stack running, state lock held, "
    "a different configuration running, an unreadable record); 5 engine/proxy exited during start-up; "
    "6 readiness timed out; 7 adapters missing, under the wrong parent or with no effect; 130 interrupted."
)

app = typer.Typer(
    name="molctl",
    help="Operate a self-hosted Mixture-of-LoRA stack (engine + MoL proxy): check, start, stop, switch, inspect. "
    "Contract (commands, exit codes, JSON shapes): docs/contract.md (installed with the package as molctl/docs/contract.md).",
    epilog=EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from molctl.output import Output

        Output().raw(f"molctl {__version__}\n")
        raise typer.Exit()


@app.callback()
def _global(
    ctx: typer.Context,
    state_dir: Optional[str] = typer.Option(
        None,
        "--state-dir",
        envvar="MOLCTL_STATE_DIR",
        help="State dir (records, logs, lock). Default: $XDG_STATE_HOME/molctl or ~/.local/state/molctl.",
    ),
    profiles_dir: List[Path] = typer.Option(
        [],
        "--profiles-dir",
        metavar="DIR",
        help="Extra profile folder, searched after the built-in one and MOLCTL_PROFILES_DIR (repeatable).",
    ),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    if state_dir is not None and not state_dir.strip():
        # `--state-dir "$UNSET"` was the current directory: up wrote its lock, records and logs there
        from molctl.output import Output

        Output().error("--state-dir '': expected a directory path (omit it for the default)")
        raise typer.Exit(int(ExitStatus.USAGE))
    for folder in profiles_dir:  # a typo was silently ignored: the profile was then "unknown"
        if not folder.expanduser().is_dir():
            from molctl.output import Output

            Output().error(f"--profiles-dir {folder}: not a directory")
            raise typer.Exit(int(ExitStatus.USAGE))
    ctx.obj = Context(Path(state_dir) if state_dir is not None else None, profiles_dir)


@app.command("profiles")
@handle_errors
def profiles_cmd(ctx: typer.Context, json_: bool = JSON_OPT) -> None:
    """List the known profiles: name, engine, served model, GPUs, ports, source file."""
    from molctl.output import Output
    from molctl.profiles import list_profiles

    out = Output(as_json=json_)
    rows, problems = list_profiles(ctx.obj.dirs())
    for problem in problems:
        out.warn(problem)
    out.profiles(rows)
    if problems:
        raise typer.Exit(int(ExitStatus.CHECK_FAILED))


app.command("lock")(lock_cmd)
app.command("check")(check_cmd)
app.command("up")(up_cmd)
app.command("switch")(switch_cmd)
app.command("down")(down_cmd)
app.command("status")(status_cmd)
app.command("reload")(reload_cmd)
app.command("logs")(logs_cmd)
app.command("top")(top_cmd)
app.command("prefetch")(prefetch_cmd)
app.add_typer(demo_app, name="demo")


def main() -> None:
    import sys

    # click's exceptions, wherever this typer takes click from (newer ones vendor it as typer._click)
    click = sys.modules[typer.BadParameter.__module__].__name__.rsplit(".", 1)[0]
    exceptions = sys.modules[f"{click}.exceptions"]
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    try:
        # not standalone: the parser's own errors come here instead of rich's multi-line box
        rv = app(prog_name="molctl", standalone_mode=False)
    except KeyboardInterrupt:  # a Ctrl-C outside any command's own handling: still exit 130, quietly
        raise SystemExit(int(ExitStatus.INTERRUPTED)) from None
    except exceptions.NoArgsIsHelpError as exc:  # `molctl`, `molctl state`: the help, as click shows it
        from typer import rich_utils

        rich_utils.rich_format_error(exc)
        raise SystemExit(exc.exit_code) from None
    except exceptions.ClickException as exc:
        raise SystemExit(_parser_error(exc)) from None
    except typer.Abort:  # EOF on a prompt (molctl has none); typer's own class, not click's
        from molctl.output import Output

        Output().error("aborted")
        raise SystemExit(int(ExitStatus.ERROR)) from None
    raise SystemExit(rv if isinstance(rv, int) else 0)


def _parser_error(exc) -> int:
    """An error the option parser found (a bad value, an unknown option, a missing argument), as
    every molctl error is: one line, `molctl: error: ...` (docs/contract.md, section 2)."""
    from molctl.output import Output

    message = " ".join(exc.format_message().split())
    try:  # a type conversion's message ("Input should be a valid integer") does not name the value
        message += f" (got {exc.__cause__.errors()[0]['input']!r})"
    except Exception:  # noqa: BLE001 - no such cause: the message names what it has
        pass
    ctx = getattr(exc, "ctx", None)
    if ctx is not None:
        message += f" (see `{ctx.command_path} --help`)"
    Output().error(message)
    return int(exc.exit_code)


app.command("proxy")(proxy_cmd)


app.command("bench")(bench_cmd)

app.add_typer(state_app, name="state")


app.add_typer(render_app, name="render")
