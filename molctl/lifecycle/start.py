"""`molctl up`: start a stack (engine, then the proxy while the engine loads) and wait until it
really serves (`molctl switch` runs its locked part, molctl.lifecycle.switch; the components are spawned
and watched by molctl.lifecycle.starter).

Every start holds the state lock (a `switch` holds it from its preflight to the end of its
`up`). Before spawning, `up` claims the stack's ports and GPUs host-wide (`molctl.claims`);
each component inherits its claims. A component is recorded right after it is spawned (pid,
start ticks, marker id, argv, host, port, log, the configuration it was started with); a record
that cannot be written stops the component at once. What a failed or interrupted start spawned
is stopped again; an engine an earlier, interrupted `up` left loading is adopted, not restarted.
The command lines come from molctl.lifecycle.launch, the reaction to stop signals from molctl.lifecycle.stopsignals.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from molctl import stackconfig
from molctl.claims import ClaimConflict, HostClaims, claim_components, release_all
from molctl.errors import ConflictError, ExitStatus, MolctlError
from molctl.lifecycle import canary
from molctl.lifecycle.launch import UpOptions
from molctl.lifecycle.progress import Progress
from molctl.lifecycle.readiness import base_url
from molctl.lifecycle.stacks import (
    component_url,
    recorded_config,
    running_profiles,
    stack_ready,
    unreadable_records_error,
)
from molctl.lifecycle.starter import Adopted, _Starter
from molctl.lifecycle.stop import clean_component, clean_stale, clean_unrecorded, down_one
from molctl.profiles import Profile
from molctl.state import (
    COMPONENTS,
    Record,
    StateLock,
    ensure_state_dir,
    is_same_process,
    read_records,
    read_records_checked,
)


class PreflightFailed(MolctlError):
    """The preflight failed; `report` holds every check (for --json)."""

    def __init__(self, message: str, exit_status: ExitStatus, report):
        super().__init__(message, exit_status)
        self.report = report


def _config_differs(records: dict[str, Record], config: dict, profile: Profile) -> str | None:
    """What differs between the running stack's configuration and the one asked for, or None."""
    recorded = recorded_config(records)
    if recorded.get("digest"):
        return None if recorded["digest"] == config["digest"] else stackconfig.differences(recorded, config)
    want = {"engine": profile.engine.port, "proxy": profile.proxy.port}  # records of an older molctl: ports only
    diff = [f"{c}.port {r.port} -> {want[c]}" for c, r in records.items() if r.port != want[c]]
    return ", ".join(diff) or None


def resolve_key_option(opts: UpOptions) -> list[str]:
    """Proxy argv for the key: the file's path, or nothing when MOLCTL_API_KEY travels in the
    environment; validated (file readable, holding a key) before anything starts."""
    from molctl.keys import resolve_api_keys

    keys = resolve_api_keys(opts.api_key_file, opts.allow_unauthenticated)
    if opts.api_key_file is not None:
        return ["--api-key-file", str(opts.api_key_file.resolve())]
    return [] if keys else ["--allow-unauthenticated"]


# ----------------------------------------------------------------------------------------------- up


def up(name: str, ctx, opts: UpOptions, progress: Progress) -> dict[str, Any]:
    """Start the stack; returns the result object (see docs/contract.md). Raises MolctlError subclasses."""
    from molctl.checks import validate_skip

    validate_skip(opts.skip)  # a typo is exit 2 before anything, not a conflict or `already_running`
    profile, config = stackconfig.load(name, ctx.dirs(), opts.overrides)
    key_args = resolve_key_option(opts)  # fail on a missing key before anything starts
    ensure_state_dir(ctx.state_dir)
    with StateLock(ctx.state_dir, "up", name):
        return _up_locked(profile, config, ctx, opts, key_args, progress)


def _up_locked(
    profile: Profile, config: dict, ctx, opts: UpOptions, key_args: list[str], progress: Progress
) -> dict[str, Any]:
    state_dir, name = ctx.state_dir, profile.name
    config = _full_config(profile, config, ctx, opts, key_args)
    t0 = time.monotonic()
    records, live = _recorded_for_up(profile, config, state_dir, opts, progress)
    if _ready_as_configured(records, config, profile):
        progress.step(f"profile {name} is already running and ready")
        return _result(profile, read_records(state_dir, name), already=True, timings={})
    clean_unrecorded(state_dir, name, progress)  # spawned by an `up` killed before it could record them
    records, live = _preflight_for_up(profile, state_dir, opts, progress, records, live)
    live = _adopt_or_clean(state_dir, name, records, live, progress)

    starter = _Starter(profile, config, ctx, opts, key_args, progress)
    try:
        claims = claim_components(
            HostClaims(), profile, state_dir, [c for c in COMPONENTS if c not in live], f"up {name}"
        )
    except ClaimConflict as exc:
        raise ConflictError(f"{exc}; nothing was started") from None
    timings, result = _start_missing(starter, profile, opts, claims, live, t0)
    timings["total_s"] = round(time.monotonic() - t0, 2)
    out = _result(profile, read_records(state_dir, name), already=False, timings=timings)
    out["canary"] = result
    out["eta"] = starter.estimate.summary()
    if starter.cache:
        out["cache"] = starter.cache
    return out


def _full_config(profile: Profile, config: dict, ctx, opts: UpOptions, key_args: list[str]) -> dict:
    """The configuration a stack is recorded with: the profile's, plus the `up` command that starts it again."""
    return {
        **config,
        "up_command": stackconfig.up_command(
            profile.name,
            opts.overrides,
            key_args,
            _explicit_state_dir(ctx),
            [Path(d).resolve() for d in opts.profiles_dirs],
            _start_options(opts),
        ),
    }


def already_running(profile: Profile, config: dict, ctx, opts: UpOptions, key_args: list[str]) -> dict | None:
    """`up`'s result when this profile already runs, ready, with this configuration; else None."""
    records, problems = read_records_checked(ctx.state_dir, profile.name)
    if problems or not _ready_as_configured(records, _full_config(profile, config, ctx, opts, key_args), profile):
        return None
    return _result(profile, records, already=True, timings={})


def _ready_as_configured(records: dict, config: dict, profile: Profile) -> bool:
    """The recorded stack is alive, ready, and was started with `config`: `up` has nothing to do."""
    return stack_ready(records) and not _config_differs(records, config, profile)


def _recorded_for_up(
    profile: Profile, config: dict, state_dir: Path, opts: UpOptions, progress: Progress
) -> tuple[dict, dict]:
    """The profile's records and those of them that are alive; refuses another running profile, an
    unreadable record, or a live stack of another configuration (unless --restart, which stops it)."""
    name = profile.name
    others = [p for p in running_profiles(state_dir) if p != name]
    if others:
        raise ConflictError(f"profile {others[0]} is running on this host; use `molctl switch {name}` to replace it")
    records, problems = read_records_checked(state_dir, name)
    if problems:
        raise unreadable_records_error(state_dir, name, problems)
    live = {c: r for c, r in records.items() if is_same_process(r)}
    if live and opts.restart:
        progress.step(f"--restart: stopping the running {name} stack first")
        down_one(state_dir, name, opts.drain_timeout_s, opts.stop_timeout_s, False, progress)
        records, live = {}, {}
    elif live:
        diff = _config_differs(records, config, profile)
        if diff:
            raise ConflictError(
                f"profile {name} is running with a different configuration ({diff}); "
                f"to restart it with this one, add --restart (`molctl up {name} --restart ...`) "
                f"or run `molctl down {name}` first"
            )
    return records, live


def _preflight_for_up(
    profile: Profile, state_dir: Path, opts: UpOptions, progress: Progress, records: dict, live: dict
) -> tuple[dict, dict]:
    """The preflight, before anything recorded is stopped: a preflight that fails (a port taken by
    a stranger, a model-root typo) leaves what runs alone, as `switch` does; ports and GPU memory
    held by this profile's own recorded processes count as its own."""
    name = profile.name
    progress.step(f"preflight checks for {name}")
    try:
        preflight(profile, state_dir, opts, progress, "nothing was started or stopped")
    except PreflightFailed as exc:
        # GPU memory or processes of a stale stack that NVML does not attribute to its recorded
        # pids (molctl in a container without the host's pid namespace: NVML lists host pids):
        # clean the stale stack, as `up` did before it checked first, then check again
        failed = {c.id for c in exc.report.checks if c.status == "fail"}
        if not (records and "engine" not in live and failed <= {"gpu.memory", "gpu.processes"}):
            raise
        progress.step(f"the GPU checks failed while leftovers of {name} run: cleaning them up, then checking again")
        clean_stale(state_dir, name, progress)
        records, live = {}, {}
        preflight(profile, state_dir, opts, progress, "nothing was started (the leftovers were stopped)")
    return records, live


def _adopt_or_clean(state_dir: Path, name: str, records: dict, live: dict, progress: Progress) -> dict:
    """What of the recorded stack `up` adopts (a live engine); the rest is stopped. Returns the live records."""
    if "engine" in live:
        # An earlier `up` that died (terminal closed, molctl killed) left its engine loading:
        # wait for it rather than throw an hour of loading away. Stop only what is stale.
        progress.step(
            f"the {name} engine started earlier is still running (pid {live['engine'].pid}); "
            "waiting for it instead of restarting it"
        )
        for component in [c for c in records if c not in live]:
            clean_component(state_dir, name, component, records[component], progress)
    elif records:
        clean_stale(state_dir, name, progress)
        live = {}
    return live


def _start_missing(
    starter: _Starter, profile: Profile, opts: UpOptions, claims: dict, live: dict, t0: float
) -> tuple[dict[str, float], dict[str, Any]]:
    """Start (or adopt) the engine, run the canary, start the proxy; wait for each. Returns the
    timings and the canary's result; on any failure the claims are released and what this `up`
    started is cleaned up."""
    canary_off = canary.enabled(profile, opts.skip)
    timings: dict[str, float] = {}
    try:
        if "engine" in live:
            engine_record, engine_proc = live["engine"], Adopted(live["engine"])
        else:
            starter.prepare_cache()
            engine_record, engine_proc = starter.start_engine(claims.get("engine", []))
            starter.watch_phases(engine_record)
        # Without the canary the proxy starts while the engine loads (its /readyz stays 503
        # until the engine serves), off the critical path. With it, the proxy starts once every
        # adapter proved its effect: no client reaches a stack whose adapter does nothing.
        if "proxy" in live:
            starter.proxy = (live["proxy"], Adopted(live["proxy"]))
        elif canary_off:
            starter.proxy = starter.start_proxy(claims.get("proxy", []), component_url(engine_record))
        timeout = opts.timeout_s if opts.timeout_s is not None else profile.engine.start_timeout_s
        starter.wait_engine(engine_record, engine_proc, timeout)
        timings["engine_ready_s"] = round(time.monotonic() - t0, 2)
        result = starter.run_canary(engine_record, canary_off)
        if isinstance(result.get("seconds"), (int, float)):
            timings["canary_s"] = round(result["seconds"], 2)
        if starter.proxy is None:
            starter.proxy = starter.start_proxy(claims.get("proxy", []), component_url(engine_record))
        starter.wait_proxy(component_url(engine_record))
    except BaseException as exc:
        release_all(claims)
        starter.clean_up(exc, adopted_engine=live.get("engine"), adopted_proxy=live.get("proxy"))
        raise
    release_all(claims)
    start = starter.record_start()
    if start is not None:
        timings["phases"] = start["phases"]
        timings["start_s"] = start["total_s"]
    return timings, result


def _start_options(opts: UpOptions) -> list[str]:
    """The options of this start that its way back (a failed switch) must repeat."""
    out: list[str] = []
    for category in dict.fromkeys(opts.skip):
        out += ["--skip", category]
    if opts.timeout_s is not None:
        out += ["--timeout", f"{opts.timeout_s:g}"]
    if opts.drain_timeout_s != UpOptions.drain_timeout_s:
        out += ["--drain-timeout", f"{opts.drain_timeout_s:g}"]
    if getattr(opts, "verify", None) is not None:
        out += ["--verify"]
        if opts.verify.manifest is not None:
            out += ["--manifest", str(opts.verify.manifest)]
        if opts.verify.full_hash:
            out += ["--full-hash"]
    return out


def _explicit_state_dir(ctx) -> Path | None:
    from molctl.state import default_state_dir

    try:
        return (
            None if Path(ctx.state_dir).absolute() == default_state_dir().absolute() else Path(ctx.state_dir).absolute()
        )
    except OSError:
        return Path(ctx.state_dir)


def preflight(
    profile: Profile,
    state_dir: Path,
    opts: UpOptions,
    progress: Progress,
    consequence: str,
    extra_skip: Iterable[str] = (),
    own_profiles: Iterable[str] = (),
) -> None:
    """The `check` categories (honouring --skip); a failure raises: exit 4 when the only failures
    are ports or GPUs held by someone else, else exit 3. The progress shows only the failures
    and warnings; the error carries the whole report (for --json)."""
    from molctl.checks import host_probes, run_checks

    probes = host_probes(state_dir, profile.name, opts.api_key_file, own_profiles=own_profiles)
    probes.verify = getattr(opts, "verify", None)  # `up --verify`: refuse a stack its manifest does not pin
    report = run_checks(profile, probes, set(opts.skip) | set(extra_skip))
    if report.ok:
        return
    progress.check_report(report)
    failed = [c for c in report.checks if c.status == "fail"]
    if all(c.id.startswith("port.") or c.id == "gpu.lock" for c in failed):
        raise PreflightFailed(f"{failed[0].detail}; {consequence}", ExitStatus.CONFLICT, report)
    raise PreflightFailed(
        f"preflight of {profile.name} failed: {len(failed)} check(s), first {failed[0].id}: "
        f"{failed[0].detail}; {consequence}",
        ExitStatus.CHECK_FAILED,
        report,
    )


def _result(profile: Profile, records: dict[str, Record], already: bool, timings: dict[str, float]) -> dict[str, Any]:
    proxy = records.get("proxy")
    endpoint = (component_url(proxy) if proxy else base_url(profile.proxy.host, profile.proxy.port)) + "/v1"
    return {
        "profile": profile.name,
        "state": "ready",
        "already_running": already,
        "endpoint": endpoint,
        "model": profile.served_model_name,
        "components": {c: {"pid": r.pid, "port": r.port, "log": r.log} for c, r in records.items()},
        "timings": timings,
    }
