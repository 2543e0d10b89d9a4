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
    for _name, path in sorted(profile_files(dirs).items()):
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
    from molctl.checks import profile_failure, run_checks
    from molctl.profiles import load_profile

    try:
        profile = load_profile(name, ctx.dirs(), overrides)
    except ProfileError as exc:
        return profile_failure(name, str(exc))
    return run_checks(profile, host_probes(ctx.state_dir, profile.name, api_key_file, probes), skip)


def host_probes(state_dir: Path, profile_name: str, api_key_file: Path | None, probes=None,
                own_profiles: Iterable[str] = ()):
    """The probes of this host for one profile (`check`, and the preflight of `up`/`switch`).
    `own_profiles`: stacks of this state dir that count as this profile's own (what a `switch`
    is about to stop): their processes, ports, GPU memory and host-wide claims are not foreign."""
    from molctl.checks import Probes
    from molctl.processes import stack_pids

    own = sorted({profile_name, *own_profiles})
    probes = probes or Probes()
    probes.state_dir = state_dir
    probes.api_key_file = api_key_file
    probes.stack_pids = lambda: set().union(*(stack_pids(state_dir, p) for p in own))
    probes.own_profiles = frozenset(own)
    return probes


def run_proxy(name: str, ctx, overrides, *, upstream: str, host: str, port: int | None, api_key_file: Path | None,
              allow_unauthenticated: bool, drain_timeout: float, sse_keepalive: float,
              log_max_bytes: int | None = None, log_backups: int = 2) -> None:
    import logging

    from molctl.engines import get_engine
    from molctl.profiles import load_profile
    from molctl.proxy.app import ProxyApp
    from molctl.proxy.server import serve

    profile = load_profile(name, ctx.dirs(), overrides)
    from molctl.keys import resolve_api_keys

    keys = resolve_api_keys(api_key_file, allow_unauthenticated)
    if log_max_bytes:
        from molctl.logs import rotate_stdio

        rotate_stdio(log_max_bytes, log_backups)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = ProxyApp(profile, get_engine(profile.engine.kind), upstream, keys, sse_keepalive_s=sse_keepalive)
    serve(app, host, port or profile.proxy.port, drain_timeout)
