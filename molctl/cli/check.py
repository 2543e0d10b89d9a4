"""`molctl lock` and `molctl check`: pin what a profile would run; validate a host before a long load."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from molctl.cli.base import (
    FULL_HASH_OPT,
    JSON_OPT,
    MANIFEST_OPT,
    MODEL_ROOT_OPT,
    SET_OPT,
    SKIP_OPT,
    VERIFY_OPT,
    _verify_options,
    handle_errors,
    overrides_from,
)
from molctl.errors import ExitStatus


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
