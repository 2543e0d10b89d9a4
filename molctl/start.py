"""`molctl up` and `molctl switch`: start a stack (engine, then the proxy while the engine loads)
and wait until it really serves.

Every start holds the state lock (a `switch` holds it from its preflight to the end of its
`up`). Before spawning, `up` claims the stack's ports and GPUs host-wide (`molctl.claims`);
each component inherits its claims. A component is recorded right after it is spawned (pid,
start ticks, marker id, argv, host, port, log, the configuration it was started with); a record
that cannot be written stops the component at once. What a failed or interrupted start spawned
is stopped again; an engine an earlier, interrupted `up` left loading is adopted, not restarted.
The command lines come from molctl.launch, the reaction to stop signals from molctl.stopsignals.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from molctl import canary, stackconfig
from molctl.claims import Claim, ClaimConflict, HostClaims, claim_components, holder_info, release_all
from molctl.engines import get_engine
from molctl.errors import ConflictError, ExitStatus, MolctlError
from molctl.launch import UpOptions, engine_argv, engine_env, proxy_argv
from molctl.processes import kill_fresh, members, new_marker, record_for, spawn, stop, tail
from molctl.profiles import Profile
from molctl.progress import Progress
from molctl.readiness import EngineReadiness, base_url, http_status, wait_ready
from molctl.stacks import component_url, recorded_config, running_profiles, stack_ready, unreadable_records_error
from molctl.state import (
    COMPONENTS,
    Record,
    StateLock,
    ensure_state_dir,
    is_same_process,
    new_log_path,
    prune_logs,
    read_records,
    read_records_checked,
    record_path,
    remove_record,
    write_record,
)
from molctl.stop import clean_component, clean_stale, clean_unrecorded, down_locked, down_one
from molctl.stopsignals import _one_more_interrupt, interrupted_by

PROXY_READY_TIMEOUT_S = 60.0
PROXY_RESTARTS = 3  # a proxy that dies while the engine loads is restarted, the engine kept


class StartFailed(MolctlError):
    """The engine or proxy exited, timed out or lacks adapters during start-up."""

    def __init__(self, message: str, exit_status: ExitStatus, log_tail: list[str] | None = None):
        super().__init__(message, exit_status)
        self.log_tail = log_tail or []


class PreflightFailed(MolctlError):
    """The preflight failed; `report` holds every check (for --json)."""

    def __init__(self, message: str, exit_status: ExitStatus, report):
        super().__init__(message, exit_status)
        self.report = report


class Adopted:
    """A component started by an earlier invocation, watched like a Popen (poll() only)."""

    def __init__(self, record: Record):
        self.record = record

    def poll(self) -> int | None:
        return None if is_same_process(self.record) else -1


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


def _keep_logs(profile: Profile) -> int:
    return int(getattr(getattr(profile, "logs", None), "keep", 10) or 0)


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
    config = {
        **config,
        "up_command": stackconfig.up_command(
            name,
            opts.overrides,
            key_args,
            _explicit_state_dir(ctx),
            [Path(d).resolve() for d in opts.profiles_dirs],
            _start_options(opts),
        ),
    }
    t0 = time.monotonic()
    records, live = _recorded_for_up(profile, config, state_dir, opts, progress)
    if records and stack_ready(records):
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
    return out


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
            engine_record, engine_proc = starter.start_engine(claims.get("engine", []))
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


class _Starter:
    """Spawns and watches the components of one `up`; stops what it started when that fails."""

    def __init__(self, profile: Profile, config: dict, ctx, opts: UpOptions, key_args: list[str], progress: Progress):
        self.profile, self.config, self.opts, self.key_args = profile, config, opts, key_args
        self.state_dir, self.name = ctx.state_dir, profile.name
        self.progress = progress
        self.started: list[Record] = []
        self.proxy: tuple[Record, Any] | None = None
        self.proxy_restarts = 0

    # spawning ---------------------------------------------------------------------------------
    def _spawn(
        self, component: str, argv: list[str], env: dict[str, str], port: int, host: str, claims: list[Claim]
    ) -> tuple[Record, Any]:
        log_path = new_log_path(self.state_dir, self.name, component)
        in_use = {r.log for r in read_records(self.state_dir, self.name).values()}
        prune_logs(self.state_dir, self.name, component, max(_keep_logs(self.profile) - 1, 0), in_use)
        rpath = record_path(self.state_dir, self.name, component)
        marker = new_marker(rpath)
        proc = spawn(argv, env, log_path, marker=marker, pass_fds=[c.fd for c in claims if c.fd is not None])
        record = None
        try:
            for claim in claims:  # the component holds its claims now, for as long as it lives
                claim.set_holder(
                    holder_info(self.name, component, self.state_dir, pid=proc.pid, command=f"up {self.name}")
                )
                claim.release()
            record = record_for(component, proc, argv, port, log_path, marker, host=host, config=self.config)
            write_record(self.state_dir, self.name, record)
            self.started.append(record)
        except BaseException as exc:
            if record is None or record not in self.started:  # not known to the clean-up yet: stop it here
                kill_fresh(proc)
                if record is not None and isinstance(exc, KeyboardInterrupt):
                    remove_record(self.state_dir, self.name, component)
            if isinstance(exc, OSError):
                raise MolctlError(
                    f"could not write the {component} record {rpath}: {exc.strerror or exc}; "
                    f"the {component} (pid {proc.pid}) was stopped"
                ) from None
            raise
        self.progress.step(f"{component} started (pid {proc.pid}), log: {log_path}")
        return record, proc

    def start_engine(self, claims: list[Claim]) -> tuple[Record, Any]:
        argv = engine_argv(self.profile)
        return self._spawn(
            "engine", argv, engine_env(self.profile), self.profile.engine.port, self.profile.engine.host, claims
        )

    def start_proxy(self, claims: list[Claim] | None, upstream: str) -> tuple[Record, Any]:
        if claims is None:
            try:
                claims = claim_components(HostClaims(), self.profile, self.state_dir, ["proxy"], f"up {self.name}")[
                    "proxy"
                ]
            except ClaimConflict as exc:
                raise StartFailed(f"cannot restart the proxy: {exc}", ExitStatus.CONFLICT) from None
        try:
            argv = proxy_argv(
                self.profile, self.opts, self.key_args, upstream, state_dir=Path(self.state_dir).absolute()
            )
            return self._spawn(
                "proxy", argv, dict(os.environ), self.profile.proxy.port, self.profile.proxy.host, claims
            )
        finally:
            release_all({"proxy": claims})

    def _proxy_exited(self, code: int, upstream: str) -> None:
        """The proxy died while the stack starts: restart it (bounded), keep the engine."""
        record, _ = self.proxy
        if self.proxy_restarts >= PROXY_RESTARTS:
            raise StartFailed(
                f"the proxy exited with code {code} during start-up, also after {PROXY_RESTARTS} "
                f"restarts (log: {record.log})",
                ExitStatus.START_FAILED,
                tail(record.log, 80),
            )
        self.proxy_restarts += 1
        self.progress.step(
            f"the proxy exited with code {code} (log: {record.log}); restarting it "
            f"({self.proxy_restarts} of {PROXY_RESTARTS}), the engine keeps running"
        )
        stop(record, 5.0)
        remove_record(self.state_dir, self.name, "proxy")
        self.started = [r for r in self.started if r is not record]
        self.proxy = self.start_proxy(None, upstream)

    # waiting ----------------------------------------------------------------------------------
    def wait_engine(self, record: Record, proc, timeout: float) -> None:
        profile = self.profile
        engine = get_engine(profile.engine.kind)
        upstream = component_url(record)

        def check_alive() -> None:
            code = proc.poll()
            if code is not None:
                raise StartFailed(
                    f"the engine exited with code {code} during start-up (log: {record.log})",
                    ExitStatus.START_FAILED,
                    tail(record.log, 80),
                )
            if self.proxy is not None:
                pcode = self.proxy[1].poll()
                if pcode is not None:
                    self._proxy_exited(pcode, upstream)

        def on_wait(elapsed: float, probe) -> None:
            phase = engine.phase(tail(record.log, 50)) or "starting"
            self.progress.waiting(elapsed, timeout, phase, probe.detail)

        probe, elapsed = wait_ready(
            EngineReadiness(profile, engine, url=upstream), timeout, check_alive=check_alive, on_wait=on_wait
        )
        if probe.state == "ready":
            self.progress.step(f"engine ready after {elapsed:.1f} s")
            return
        stop(record, self.opts.stop_timeout_s)  # `--stop-timeout`, as every other stop of `up` that the operator sets
        if probe.state == "adapters":
            raise StartFailed(f"the engine is up but {probe.detail}; it was stopped", ExitStatus.ADAPTERS)
        if probe.state == "version":  # the running server is not the pinned engine version
            raise StartFailed(f"the engine is up but {probe.detail}; it was stopped", ExitStatus.CHECK_FAILED)
        raise StartFailed(
            f"the engine was not ready within {timeout:.0f} s ({probe.detail}); it was stopped (log: {record.log})",
            ExitStatus.TIMEOUT,
            tail(record.log, 20),
        )

    def run_canary(self, record: Record, off: str | None) -> dict[str, Any]:
        """The adapter efficacy canary against the ready engine (molctl.canary), before the proxy
        starts; its result goes into the engine's record (for `status`) and log. An adapter with
        no effect, or a canary request that fails, stops the engine: exit 7."""
        if off is not None:
            result = canary.skipped(off)
        else:
            self.progress.step("adapter efficacy canary: the base model and L0-L3, greedy, with logprobs")
            result = canary.run(self.profile, get_engine(self.profile.engine.kind), component_url(record))
        line = canary.summary_line(result)
        canary.append_to_log(record.log, line)
        for warning in result.get("warnings", []):
            self.progress.warn(warning)
        if result["status"] in ("fail", "error"):
            stop(record, self.opts.stop_timeout_s)
            raise StartFailed(
                f"the engine is up but {canary.failure_message(result)}; it was stopped", ExitStatus.ADAPTERS
            )
        self.progress.step(line)
        record.extra = {**record.extra, "canary": result}
        try:
            write_record(self.state_dir, self.name, record)
        except OSError as exc:  # the stack serves; only `status` lacks the canary's result
            self.progress.warn(f"could not write the canary's result into the engine record: {exc.strerror or exc}")
        return result

    def wait_proxy(self, upstream: str) -> None:
        deadline = time.monotonic() + PROXY_READY_TIMEOUT_S
        while True:
            record, proc = self.proxy
            code = proc.poll()
            if code is not None:
                self._proxy_exited(code, upstream)
                deadline = time.monotonic() + PROXY_READY_TIMEOUT_S
                continue
            if http_status(component_url(record) + "/readyz") == 200:
                return
            if time.monotonic() >= deadline:
                raise StartFailed(
                    f"the proxy was not ready within {PROXY_READY_TIMEOUT_S:.0f} s (log: {record.log})",
                    ExitStatus.START_FAILED,
                    tail(record.log, 80),
                )
            time.sleep(0.1)

    # failure ----------------------------------------------------------------------------------
    def clean_up(self, exc: BaseException, adopted_engine: Record | None, adopted_proxy: Record | None = None) -> None:
        """Stop what this invocation started (and an adopted engine that failed); a second Ctrl-C
        here is reported with what may still run and how to stop it."""
        interrupted = isinstance(exc, KeyboardInterrupt)
        if interrupted:
            _one_more_interrupt()
            self.progress.step(
                f"interrupted{interrupted_by()}: stopping what this command started (Ctrl-C again leaves it running)"
            )
        try:
            for record in reversed(self.started):
                stop(record, 10.0)
                remove_record(self.state_dir, self.name, record.component)
            if isinstance(exc, StartFailed) and adopted_engine is not None:
                stop(adopted_engine, 10.0)
                remove_record(self.state_dir, self.name, "engine")
            if isinstance(exc, StartFailed) and exc.exit_status == ExitStatus.ADAPTERS and adopted_proxy is not None:
                stop(adopted_proxy, 10.0)  # it would serve an engine that was stopped
                remove_record(self.state_dir, self.name, "proxy")
        except KeyboardInterrupt:
            left = [
                f"{r.component} (pid {r.pid})"
                for r in [*self.started, *([adopted_engine] if adopted_engine else [])]
                if members(r)
            ]
            what = ", ".join(left) or "nothing"
            raise MolctlError(
                f"interrupted again while stopping: still running: {what}; the engine may keep its GPUs "
                f"and ports: run `molctl down {self.name}` to stop it",
                ExitStatus.INTERRUPTED,
            ) from None
        if interrupted:
            kept = " (the engine started earlier keeps running: molctl down stops it)" if adopted_engine else ""
            raise MolctlError(
                f"interrupted{interrupted_by()}; everything this command started was stopped{kept}",
                ExitStatus.INTERRUPTED,
            ) from None


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


# --------------------------------------------------------------------------------------------- switch


def switch(name: str, ctx, opts: UpOptions, progress: Progress) -> dict[str, Any]:
    """Drain and stop whatever runs, then `up` the profile, holding the state lock throughout
    (no other `up` can start in between). If the new profile fails its preflight (checked without
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
        # ports included: those the running stacks hold count as their own (own_profiles), a
        # stranger's fails the switch before the running stack is stopped
        preflight(profile, state_dir, opts, progress, "the running stack was left alone", own_profiles=running)
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
    timings = result.get("timings", {})
    # total_s of a switch covers the whole switch: the old stack's stop plus the new one's start
    result["timings"] = {
        **timings,
        "stop_s": round(t_down, 2),
        "total_s": round(t_down + timings.get("total_s", 0.0), 2),
    }
    result["stopped"] = [s["profile"] for s in (stopped or {}).get("stopped", [])]
    return result


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
