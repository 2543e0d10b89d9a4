"""Core operations behind the CLI commands, as plain functions over a `Context`-like object
(state_dir, dirs()) so they can be called in-process by tests and other tools."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from molctl.errors import ProfileError


def list_profiles(dirs: list[Path]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every profile found, and a one-line problem per file that does not load."""
    from molctl.profiles import load_profile_file, profile_files

    rows, problems = [], []
    for name, path in sorted(profile_files(dirs).items()):
        try:
            p = load_profile_file(path)
        except ProfileError as exc:
            problems.append(str(exc))
            continue
        rows.append({
            "name": p.name, "engine": p.engine.kind, "engine_version": p.engine.version,
            "served_model_name": p.served_model_name, "gpus": p.engine.gpus,
            "engine_port": p.engine.port, "proxy_port": p.proxy.port, "source": str(path),
            "description": p.description,
        })
    return rows, problems


def check_profile(name: str, ctx, overrides: Iterable[tuple[str, Any]], skip: Iterable[str],
                  api_key_file: Path | None = None, probes=None):
    """Load the profile (a load failure becomes a failed `profile.valid` check) and run checks."""
    from molctl.checks import Probes, profile_failure, run_checks
    from molctl.profiles import load_profile
    from molctl.state import stack_pids

    try:
        profile = load_profile(name, ctx.dirs(), overrides)
    except ProfileError as exc:
        return profile_failure(name, str(exc))
    if probes is None:
        probes = Probes()
    probes.state_dir = ctx.state_dir
    probes.api_key_file = api_key_file
    probes.stack_pids = lambda: stack_pids(ctx.state_dir, profile.name)
    return run_checks(profile, probes, skip)
