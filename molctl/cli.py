"""The command line: parse options, call the module that does the work, hand its result to an
`molctl.output.Output` method. No logic and no rendering live here.

Exit codes are `molctl.errors.ExitStatus`; every `MolctlError` becomes one line on stderr. The
contract (commands, exit codes, JSON shapes) is in docs/contract.md."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional, Tuple

import typer

from molctl import __version__
from molctl.clibase import (
    DRAIN_OPT,
    JSON_OPT,
    KEY_FILE_OPT,
    MODEL_ROOT_OPT,
    SET_OPT,
    SKIP_OPT,
    STOP_OPT,
    TIMEOUT_OPT,
    UNAUTH_OPT,
    Context,
    _positive,
    handle_errors,
    overrides_from,
)
from molctl.cliproxy import proxy_cmd, state_app
from molctl.clirender import render_app
from molctl.errors import ExitStatus, MolctlError

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


VERIFY_OPT = typer.Option(
    False, "--verify", help="Also compare the host with a `molctl lock` manifest (the `lock` check category)."
)
MANIFEST_OPT = typer.Option(
    None,
    "--manifest",
    metavar="PATH",
    help="The manifest for --verify (implies it; default: the profile's newest in STATE/PROFILE/manifests).",
)
FULL_HASH_OPT = typer.Option(
    False,
    "--full-hash",
    help="With --verify (implies it): read every pinned file and compare its SHA-256, not only sizes and mtimes.",
)


def _verify_options(verify: bool, manifest: Optional[Path], full_hash: bool):
    """A `molctl.checks.verify.Verify` when --verify, --manifest or --full-hash is given, else None."""
    if not (verify or manifest is not None or full_hash):
        return None
    from molctl.checks.verify import Verify

    return Verify(manifest=manifest.expanduser().absolute() if manifest is not None else None, full_hash=full_hash)


@app.command("lock")
@handle_errors
def lock_cmd(
    ctx: typer.Context,
    profile: str = typer.Argument(..., help="Profile to pin (see `molctl profiles`)."),
    model_root: Optional[Path] = MODEL_ROOT_OPT,
    set_: List[str] = SET_OPT,
    jobs: Optional[int] = typer.Option(
        None,
        "--jobs",
        "-j",
        min=1,
        help="Files hashed in parallel (default: the cores, at most 8; at most 2 on a rotational disk).",
    ),
    output: Optional[Path] = typer.Option(
        None,
        "--output",
        "-o",
        metavar="PATH",
        help="Where to write the manifest (default: STATE/PROFILE/manifests/lock-<UTC time>.json).",
    ),
    json_: bool = JSON_OPT,
) -> None:
    """Pin what PROFILE would run: engine version and fingerprint, argv, env, base and adapter files (SHA-256), capacity flags."""
    from molctl.manifest import lock
    from molctl.output import Output
    from molctl.profiles import load_profile
    from molctl.state import ensure_state_dir

    out = Output(as_json=json_)
    prof = load_profile(profile, ctx.obj.dirs(), overrides_from(model_root, set_))
    ensure_state_dir(ctx.obj.state_dir)
    target = output.expanduser().absolute() if output is not None else None
    result = lock(prof, ctx.obj.state_dir, output=target, jobs=jobs, progress=out.hash_progress())
    out.lock_result(result.summary())


@app.command("check")
@handle_errors
def check_cmd(
    ctx: typer.Context,
    profile: str = typer.Argument(..., help="Profile name (see `molctl profiles`)."),
    model_root: Optional[Path] = MODEL_ROOT_OPT,
    set_: List[str] = SET_OPT,
    skip: List[str] = SKIP_OPT,
    api_key_file: Optional[Path] = typer.Option(
        None,
        "--api-key-file",
        envvar="MOLCTL_API_KEY_FILE",
        help="Also check this proxy API key file (mode 0600, one key per line).",
    ),
    verify: bool = VERIFY_OPT,
    manifest: Optional[Path] = MANIFEST_OPT,
    full_hash: bool = FULL_HASH_OPT,
    live: bool = typer.Option(
        False,
        "--live",
        help="Also run the adapter efficacy canary against the profile's running engine (the adapter-effect category).",
    ),
    json_: bool = JSON_OPT,
) -> None:
    """Validate the host, the model files and the engine before a long load. Exit 3 on any failure."""
    from molctl.checks import check_profile
    from molctl.checks.result import Probes
    from molctl.output import Output

    out = Output(as_json=json_)
    verify_opts = _verify_options(verify, manifest, full_hash)
    probes = Probes(verify=verify_opts) if verify_opts is not None else None
    report = check_profile(profile, ctx.obj, overrides_from(model_root, set_), skip, api_key_file, probes, live=live)
    out.check_report(report)
    if not report.ok:
        raise typer.Exit(int(ExitStatus.CHECK_FAILED))


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
    from molctl.launch import UpOptions

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
    from molctl.output import ConsoleProgress, Output
    from molctl.start import StartFailed
    from molctl.stopsignals import interrupt_on_stop_signals

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
                from molctl.stopsignals import ignore_stop_signals

                ignore_stop_signals()  # a late Ctrl-C must not cut the report
            out.error(str(exc))
            raise typer.Exit(int(exc.exit_status)) from None
        raise
    progress.close()
    out.up_result(result)


@app.command("up")
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
    from molctl.start import up

    opts = _up_options(
        ctx, model_root, set_, skip, timeout, api_key_file, allow_unauthenticated, drain_timeout, stop_timeout, restart
    )
    opts.verify = _verify_options(verify, manifest, full_hash)
    _run_start(profile, json_, lambda progress: up(profile, ctx.obj, opts, progress))


@app.command("switch")
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
    json_: bool = JSON_OPT,
) -> None:
    """Drain and stop whatever stack runs, then `up PROFILE`. A failing preflight stops nothing."""
    from molctl.start import switch

    opts = _up_options(
        ctx, model_root, set_, skip, timeout, api_key_file, allow_unauthenticated, drain_timeout, stop_timeout
    )
    _run_start(profile, json_, lambda progress: switch(profile, ctx.obj, opts, progress))


@app.command("down")
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
    from molctl.output import ConsoleProgress, Output
    from molctl.stop import down

    out = Output(as_json=json_)
    progress = ConsoleProgress(out)
    try:
        result = down(ctx.obj, profile, drain_timeout, force, progress, engine_timeout_s=stop_timeout)
    finally:
        progress.close()
    out.down_result(result)


@app.command("status")
@handle_errors
def status_cmd(
    ctx: typer.Context,
    profile: Optional[str] = typer.Argument(None, help="Profile (default: every recorded stack)."),
    json_: bool = JSON_OPT,
) -> None:
    """Recorded stacks, probed live: processes, ports, /health, /readyz, uptime, logs, GPU memory."""
    from molctl.output import Output
    from molctl.status import status

    Output(as_json=json_).status(status(ctx.obj, profile))


@app.command("reload")
@handle_errors
def reload_cmd(
    ctx: typer.Context,
    profile: str = typer.Argument(..., help="Profile whose running proxy re-reads its API key file."),
    json_: bool = JSON_OPT,
) -> None:
    """Make the running proxy re-read its API key file (SIGHUP), without dropping connections."""
    from molctl.output import Output
    from molctl.reload import reload

    result = reload(ctx.obj, profile)
    if json_:
        Output(as_json=True).json(result)  # indent 2, as every --json (docs/contract.md, section 3)
    else:
        typer.echo(
            f"{profile}: sent SIGHUP to the proxy (pid {result['pid']}); it re-reads its key file "
            f"(molctl logs {profile} --component proxy shows the outcome)"
        )


@app.command("logs")
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


@app.command("top")
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


demo_app = typer.Typer(
    help="The tiny demo model: a whole MoL stack on any machine, no GPU, no download.", no_args_is_help=True
)
app.add_typer(demo_app, name="demo")


@demo_app.command("init")
@handle_errors
def demo_init_cmd(
    ctx: typer.Context,
    directory: Optional[Path] = typer.Argument(
        None, help="Where to write it (default: the tiny profile's model_root)."
    ),
    seed: int = typer.Option(0, "--seed", help="Random seed (the output is deterministic per seed)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing non-empty directory."),
    if_missing: bool = typer.Option(
        False, "--if-missing", help="Do nothing when a complete tiny model is already there."
    ),
    template: str = typer.Option(
        "qwen3.6",
        "--template",
        help="Chat template rules: qwen3.6 (the Tall base's family; profile tiny) or glm5 (Venti's).",
    ),
    no_effect: List[str] = typer.Option(
        [],
        "--no-effect",
        metavar="ROUTE=KIND",
        help="Write adapter ROUTE with no effect, for the efficacy canary: zero-b (zero "
        "lora_B) or off-target (o_proj only: no effect under --lora-target-modules "
        "q_proj v_proj) (repeatable).",
    ),
    json_: bool = JSON_OPT,
) -> None:
    """Generate the tiny base model (tokenizer, config, chat template, 2 safetensors shards) and LoRA adapters L0-L3."""
    from molctl.demo import TEMPLATES, init_tiny, parse_no_effect
    from molctl.errors import UsageError
    from molctl.output import Output
    from molctl.profiles import load_profile

    if template not in TEMPLATES:
        raise UsageError(f"--template {template!r}: expected one of {', '.join(TEMPLATES)}")
    if seed < 0:  # numpy's seeds are non-negative: a traceback (exit 1) after --force had deleted the model
        raise UsageError(f"--seed {seed}: expected 0 or more")
    out = Output(as_json=json_)
    root = directory or load_profile("tiny", ctx.obj.dirs()).model_root
    result = init_tiny(
        root, seed=seed, force=force, if_missing=if_missing, template=template, no_effect=parse_no_effect(no_effect)
    )
    out.demo_init(result, template, seed)


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


@app.command("bench")
@handle_errors
def bench_cmd(
    ctx: typer.Context,
    profile: Optional[str] = typer.Argument(
        None, help="Profile whose running stack to measure (with --compare: where run ids are looked up)."
    ),
    concurrency: str = typer.Option("1,4,8", "--concurrency", help="Concurrency levels, comma-separated."),
    requests: Optional[int] = typer.Option(None, "--requests", min=1, help="Requests per series and concurrency."),
    duration: Optional[float] = typer.Option(
        None,
        "--duration",
        callback=_positive,
        help="Seconds per series and concurrency (default 2.5 when --requests is not given).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the prompt set and the mix's order."),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1, help="max_tokens of every request."),
    series: str = typer.Option(
        ",".join(("base", "L0", "L1", "L2", "L3", "mix", "proxy", "canary")),
        "--series",
        help="Series to run (base is always measured first): base,L0,L1,L2,L3,mix,proxy,canary "
        "(the adapter efficacy canary, once).",
    ),
    request_timeout: float = typer.Option(
        60.0, "--request-timeout", callback=_positive, help="Seconds one request may take."
    ),
    api_key_file: Optional[Path] = typer.Option(
        None,
        "--api-key-file",
        envvar="MOLCTL_API_KEY_FILE",
        help="The proxy's API key (first line) for the proxy series. Or set MOLCTL_API_KEY.",
    ),
    output: Optional[Path] = typer.Option(
        None, "--output", metavar="DIR", help="Run directory (default STATE/PROFILE/bench/RUN_ID)."
    ),
    compare: Optional[Tuple[str, str]] = typer.Option(
        None,
        "--compare",
        metavar="RUN_A RUN_B",
        help="Print the differences between two runs (run ids or run directories).",
    ),
    json_: bool = JSON_OPT,
) -> None:
    """Measure the running stack: base-only, each adapter, a 25/25/25/25 mix, and through the proxy (seed 002)."""
    from molctl import bench as b
    from molctl.bench.compare import compare as compare_runs
    from molctl.bench.compare import load_run
    from molctl.bench.run import bench
    from molctl.errors import UsageError
    from molctl.output import Output

    out = Output(as_json=json_)
    if compare and all(compare):
        out.bench(
            compare_runs(
                load_run(ctx.obj.state_dir, profile, compare[0]), load_run(ctx.obj.state_dir, profile, compare[1])
            )
        )
        return
    if profile is None:
        raise UsageError("bench needs PROFILE (or --compare RUN_A RUN_B)")
    if requests is not None and duration is not None:
        raise UsageError("--requests and --duration exclude each other")
    opts = b.BenchOptions(
        concurrency=b.parse_concurrency(concurrency),
        requests=requests,
        duration_s=duration,
        seed=seed,
        max_tokens=max_tokens,
        series=b.parse_series(series),
        api_key=b.api_key_from(api_key_file),
        request_timeout_s=request_timeout,
        output=output.expanduser().absolute() if output is not None else None,
    )
    out.bench(bench(ctx.obj, profile, opts, progress=None if json_ else lambda m: out.line(f"molctl: bench {m}")))


app.add_typer(state_app, name="state")


app.add_typer(render_app, name="render")
