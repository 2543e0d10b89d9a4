"""Preflight checks: plain functions over a `Profile` and injected `Probes`.

Each category module exposes `run(profile, probes) -> list[CheckResult]`. Ids are stable dotted
names whose prefix is the category (see docs/contract.md); a failing result's detail names the
exact file, value and expectation.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from molctl.checks import cachedir, engine, host, loadstrategy, model, template, verify
from molctl.checks import live as live_checks
from molctl.checks.result import CheckResult, Probes, Report

CATEGORIES = ("profile", "engine", "gpu", "model", "adapter", "template", "port", "state", "security")
# categories of a live engine, not of the host: the adapter efficacy canary (molctl.lifecycle.canary) that
# `up`/`switch` run before the proxy starts and `check --live` runs against the running stack
LIVE_CATEGORIES = ("adapter-effect",)


def validate_skip(skip: Iterable[str]) -> set[str]:
    """The --skip categories; an unknown one (or `profile`, which cannot be skipped) is a usage
    error (exit 2). `up` and `switch` call it before anything else, not only in their preflight."""
    skip = set(skip)
    # `profile` cannot be skipped (it was accepted and ignored)
    unknown = skip - (set(CATEGORIES) - {"profile"}) - set(LIVE_CATEGORIES)
    if unknown:
        from molctl.errors import UsageError

        raise UsageError(
            f"--skip {sorted(unknown)[0]!r}: expected one of {', '.join(CATEGORIES[1:] + LIVE_CATEGORIES)}"
        )
    return skip


# each category's checks, in the order they run: functions (profile, probes) -> list[CheckResult]
CATEGORY_CHECKS = {
    "engine": (engine.run,),
    "gpu": (host.run_gpu,),
    "model": (model.run_model, loadstrategy.run),
    "adapter": (model.run_adapters,),
    "template": (template.run,),
    "port": (host.run_ports,),
    "state": (host.run_state, cachedir.run),
    "security": (host.run_security,),
}


def run_checks(profile, probes: Probes, skip: Iterable[str] = ()) -> Report:
    skip = validate_skip(skip)
    runners = dict(CATEGORY_CHECKS)
    if probes.verify is not None:  # `--verify`: the host compared with a `molctl lock` manifest, last
        runners["lock"] = (verify.run,)
    results = [CheckResult("profile.valid", "pass", f"{profile.source} is a valid profile")]
    for category, checks in runners.items():
        if category in skip:
            results.append(CheckResult(f"{category}.skipped", "skip", f"skipped (--skip {category})"))
            continue
        for check in checks:
            results.extend(check(profile, probes))
    return Report(profile.name, results)


def check_profile(
    name: str,
    ctx,
    overrides: Iterable[tuple[str, Any]],
    skip: Iterable[str],
    api_key_file: Path | None = None,
    probes: Probes | None = None,
    live: bool = False,
) -> Report:
    """`molctl check`: load the profile (a load failure becomes a failed `profile.valid` check)
    and run the checks on this host; `live` (`--live`): then the LIVE_CATEGORIES against the
    profile's running stack (molctl.checks.live). `ctx` gives state_dir and dirs() (the CLI's Context)."""
    from molctl.errors import ProfileError
    from molctl.profiles import load_profile

    try:
        profile = load_profile(name, ctx.dirs(), overrides)
    except ProfileError as exc:
        return profile_failure(name, str(exc))
    probes = host_probes(ctx.state_dir, profile.name, api_key_file, probes)
    report = run_checks(profile, probes, skip)
    if live:
        for category in LIVE_CATEGORIES:
            if category in set(skip):
                report.checks.append(CheckResult(f"{category}.skipped", "skip", f"skipped (--skip {category})"))
            else:
                report.checks.extend(live_checks.run(profile, probes, ctx))
    return report


def host_probes(
    state_dir: Path,
    profile_name: str,
    api_key_file: Path | None,
    probes: Probes | None = None,
    own_profiles: Iterable[str] = (),
) -> Probes:
    """The probes of this host for one profile (`check`, and the preflight of `up`/`switch`).
    `own_profiles`: stacks of this state dir that count as this profile's own (what a `switch`
    is about to stop): their processes, ports, GPU memory and host-wide claims are not foreign."""
    from molctl.processes import stack_pids

    own = sorted({profile_name, *own_profiles})
    probes = probes or Probes()
    probes.state_dir = state_dir
    probes.api_key_file = api_key_file
    probes.stack_pids = lambda: set().union(*(stack_pids(state_dir, p) for p in own))
    probes.own_profiles = frozenset(own)
    return probes


def profile_failure(name: str, message: str) -> Report:
    """A report for a profile that failed to load (so `check --json` keeps its shape)."""
    return Report(name, [CheckResult("profile.valid", "fail", message)])
