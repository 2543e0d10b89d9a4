"""up / down / switch / status: the stack's lifecycle over records in the state dir.

Every mutating command holds the state lock (a `switch` holds it from its preflight to the end
of its `up`). Before spawning, `up` claims the stack's ports and GPUs host-wide
(`molctl.hostlocks`); each component inherits its claims. A component is recorded right after
it is spawned (pid, start ticks, marker id, argv, host, port, log, the configuration it was
started with); a record that cannot be written stops the component at once. Records are
removed only once no process of the component survives.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from molctl import stackconfig
from molctl.engines import get_engine
from molctl.errors import ConflictError, ExitStatus, MolctlError, ProfileError
from molctl.hostlocks import Claim, ClaimConflict, HostLocks, claim_components, holder_info, release_all
from molctl.processes import (kill_fresh, marked_by_path, members, new_marker, record_for, spawn, stack_pids, stop,
                              stop_processes, tail)
from molctl.profiles import Profile, load_profile, profile_files
from molctl.readiness import EngineReadiness, base_url, http_status
from molctl.state import (COMPONENTS, Record, RecordProblem, StateDirError, StateLock, ensure_state_dir,
                          is_same_process, lock_holder, new_log_path, process_state, profiles_with_records,
                          prune_logs, read_records, read_records_checked, record_path, remove_record, write_record)

POLL_S = 0.5  # "about once a second" or better: a refused connect costs nothing
ENGINE_STOP_TIMEOUT_S = 60.0
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


@dataclass
class UpOptions:
    overrides: list[tuple[str, Any]] = field(default_factory=list)
    skip: Iterable[str] = ()
    timeout_s: float | None = None
    api_key_file: Path | None = None
    allow_unauthenticated: bool = False
    drain_timeout_s: float = 600.0
    profiles_dirs: list[Path] = field(default_factory=list)
    restart: bool = False  # stop this profile's running stack first (another configuration, or a plain restart)
    stop_timeout_s: float = ENGINE_STOP_TIMEOUT_S  # for what `up --restart` / `switch` stop


class Reporter:
    """What `up` tells the operator while it works; the output layer implements it."""

    def step(self, message: str) -> None: ...
    def waiting(self, elapsed: float, deadline: float, phase: str, detail: str) -> None: ...
    def check_report(self, report) -> None: ...


def engine_env(profile: Profile) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in profile.engine.unset_env}
    env.update(profile.engine.env)
    env.pop("MOLCTL_API_KEY", None)  # the engine never needs the proxy's key
    return env


class Adopted:
    """A component started by an earlier invocation, watched like a Popen (poll() only)."""

    def __init__(self, record: Record):
        self.record = record

    def poll(self) -> int | None:
        return None if is_same_process(self.record) else -1


def clean_stale(state_dir: Path, name: str, say: Callable[[str], None]) -> None:
    """Stop what is left of this profile's recorded components (ours by identity or marker) and
    remove their records. A pid now owned by an unrelated process is never signalled."""
    for component, record in read_records(state_dir, name).items():
        _clean_component(state_dir, name, component, record, say)


def _clean_component(state_dir: Path, name: str, component: str, record: Record, say: Callable[[str], None]) -> None:
    procs = members(record)
    if procs:
        say(f"cleaning up {len(procs)} leftover process(es) of the {component} (pid {record.pid})")
        result = stop(record, 10.0)
        if not result.ok:
            raise MolctlError(f"could not stop leftover {component} processes: {', '.join(result.survivors)}")
    elif process_state(record) == "uncertain":
        raise ConflictError(f"the {component} record of {name} names pid {record.pid}, which runs but cannot be "
                            f"verified as the recorded process; it is not touched: check it, then "
                            f"`molctl down {name} --force` removes the record")
    elif _pid_exists(record.pid):
        say(f"stale {component} record: pid {record.pid} now belongs to another process; not touching it")
    remove_record(state_dir, name, component)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def running_profiles(state_dir: Path) -> list[str]:
    return [p for p in profiles_with_records(state_dir) if stack_pids(state_dir, p)
            or read_records_checked(state_dir, p)[1]]


def _url(record: Record) -> str:
    return base_url(record.host, record.port)


def stack_ready(records: dict[str, Record]) -> bool:
    """Both recorded components alive and healthy, probed on their recorded host and port."""
    if set(records) != set(COMPONENTS) or not all(is_same_process(r) for r in records.values()):
        return False
    return http_status(_url(records["engine"]) + "/health") == 200 and http_status(_url(records["proxy"]) + "/readyz") == 200


def recorded_config(records: dict[str, Record]) -> dict:
    for component in COMPONENTS:
        if component in records and records[component].config:
            return records[component].config
    return {}


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


def proxy_argv(profile: Profile, opts: UpOptions, key_args: list[str], upstream: str) -> list[str]:
    """The proxy's command line. The start's overrides travel as typed JSON (`--set-json`), never
    re-parsed as text: `--set 'served_model_name="2024"'` reaches the proxy as the string 2024."""
    argv = [sys.executable, "-m", "molctl"]
    for d in opts.profiles_dirs:
        argv += ["--profiles-dir", str(Path(d).resolve())]
    argv += ["proxy", profile.name, "--upstream", upstream, "--host", profile.proxy.host,
             "--port", str(profile.proxy.port), "--drain-timeout", str(opts.drain_timeout_s)]
    if opts.overrides:
        argv += ["--set-json", json.dumps([[k, v] for k, v in opts.overrides])]
    log_opts = profile_log_options(profile)
    if log_opts:
        argv += log_opts
    return argv + key_args


def profile_log_options(profile: Profile) -> list[str]:
    logs = getattr(profile, "logs", None)
    max_bytes = getattr(logs, "max_bytes", None)
    if not max_bytes:
        return []
    return ["--log-max-bytes", str(int(max_bytes)), "--log-backups", str(int(getattr(logs, "backups", 2)))]


def _keep_logs(profile: Profile) -> int:
    return int(getattr(getattr(profile, "logs", None), "keep", 10) or 0)


# ----------------------------------------------------------------------------------------------- up

def up(name: str, ctx, opts: UpOptions, reporter: Reporter, probes_factory=None,
       sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Start the stack; returns the result object (see README). Raises MolctlError subclasses."""
    profile, config = stackconfig.load(name, ctx.dirs(), opts.overrides)
    key_args = resolve_key_option(opts)  # fail on a missing key before anything starts
    ensure_state_dir(ctx.state_dir)
    with StateLock(ctx.state_dir, f"up {name}"):
        return _up_locked(profile, config, ctx, opts, key_args, reporter, probes_factory, sleep)


def _up_locked(profile: Profile, config: dict, ctx, opts: UpOptions, key_args: list[str], reporter: Reporter,
               probes_factory, sleep) -> dict[str, Any]:
    state_dir, name = ctx.state_dir, profile.name
    config = {**config, "up_command": stackconfig.up_command(name, opts.overrides, key_args, _explicit_state_dir(ctx),
                                                             [Path(d).resolve() for d in opts.profiles_dirs])}
    t0 = time.monotonic()
    others = [p for p in running_profiles(state_dir) if p != name]
    if others:
        raise ConflictError(f"profile {others[0]} is running on this host; use `molctl switch {name}` to replace it")
    records, problems = read_records_checked(state_dir, name)
    if problems:
        raise unreadable_records_error(state_dir, name, problems)
    live = {c: r for c, r in records.items() if is_same_process(r)}
    if live and opts.restart:
        reporter.step(f"--restart: stopping the running {name} stack first")
        _down_one(state_dir, name, opts.drain_timeout_s, opts.stop_timeout_s, False, reporter.step, reporter.step, None)
        records, live = {}, {}
    elif live:
        diff = _config_differs(records, config, profile)
        if diff:
            raise ConflictError(f"profile {name} is running with a different configuration ({diff}); "
                                f"to restart it with this one, add --restart (`molctl up {name} --restart ...`) "
                                f"or run `molctl down {name}` first")
    if records and stack_ready(records):
        reporter.step(f"profile {name} is already running and ready")
        return _result(profile, read_records(state_dir, name), already=True, timings={})
    if "engine" in live:
        # An earlier `up` that died (terminal closed, molctl killed) left its engine loading:
        # wait for it rather than throw an hour of loading away. Stop only what is stale.
        reporter.step(f"the {name} engine started earlier is still running (pid {live['engine'].pid}); "
                      "waiting for it instead of restarting it")
        for component in [c for c in records if c not in live]:
            _clean_component(state_dir, name, component, records[component], reporter.step)
    elif records:
        clean_stale(state_dir, name, reporter.step)
        live = {}

    reporter.step(f"preflight checks for {name}")
    preflight(profile, state_dir, opts, reporter, probes_factory, "nothing was started")

    starter = _Starter(profile, config, ctx, opts, key_args, reporter, sleep)
    try:
        claims = claim_components(HostLocks(), profile, state_dir, [c for c in COMPONENTS if c not in live], f"up {name}")
    except ClaimConflict as exc:
        raise ConflictError(f"{exc}; nothing was started") from None
    try:
        if "engine" in live:
            engine_record, engine_proc = live["engine"], Adopted(live["engine"])
        else:
            engine_record, engine_proc = starter.start_engine(claims.get("engine", []))
        # The proxy starts while the engine loads (its /readyz stays 503 until the engine
        # serves), so its own start-up is off the critical path.
        if "proxy" in live:
            starter.proxy = (live["proxy"], Adopted(live["proxy"]))
        else:
            starter.proxy = starter.start_proxy(claims.get("proxy", []), _url(engine_record))
        timeout = opts.timeout_s if opts.timeout_s is not None else profile.engine.start_timeout_s
        starter.wait_engine(engine_record, engine_proc, timeout)
        t_engine = time.monotonic() - t0
        starter.wait_proxy(_url(engine_record))
    except BaseException as exc:
        release_all(claims)
        starter.clean_up(exc, adopted_engine=live.get("engine"))
        raise
    release_all(claims)
    total = time.monotonic() - t0
    return _result(profile, read_records(state_dir, name), already=False,
                   timings={"engine_ready_s": round(t_engine, 2), "total_s": round(total, 2)})


def _explicit_state_dir(ctx) -> Path | None:
    from molctl.state import default_state_dir

    try:
        return None if Path(ctx.state_dir).absolute() == default_state_dir().absolute() else Path(ctx.state_dir).absolute()
    except OSError:
        return Path(ctx.state_dir)


class _Starter:
    """Spawns and watches the components of one `up`; stops what it started when that fails."""

    def __init__(self, profile: Profile, config: dict, ctx, opts: UpOptions, key_args: list[str], reporter: Reporter,
                 sleep):
        self.profile, self.config, self.opts, self.key_args = profile, config, opts, key_args
        self.state_dir, self.name = ctx.state_dir, profile.name
        self.reporter, self.sleep = reporter, sleep
        self.started: list[Record] = []
        self.proxy: tuple[Record, Any] | None = None
        self.proxy_restarts = 0

    # spawning ---------------------------------------------------------------------------------
    def _spawn(self, component: str, argv: list[str], env: dict[str, str], port: int, host: str,
               claims: list[Claim]) -> tuple[Record, Any]:
        log_path = new_log_path(self.state_dir, self.name, component)
        in_use = {r.log for r in read_records(self.state_dir, self.name).values()}
        prune_logs(self.state_dir, self.name, component, max(_keep_logs(self.profile) - 1, 0), in_use)
        rpath = record_path(self.state_dir, self.name, component)
        marker = new_marker(rpath)
        proc = spawn(argv, env, log_path, marker=marker, pass_fds=[c.fd for c in claims if c.fd is not None])
        record = None
        try:
            for claim in claims:  # the component holds its claims now, for as long as it lives
                claim.set_holder(holder_info(self.name, component, self.state_dir, pid=proc.pid, command=f"up {self.name}"))
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
                raise MolctlError(f"could not write the {component} record {rpath}: {exc.strerror or exc}; "
                                  f"the {component} (pid {proc.pid}) was stopped") from None
            raise
        self.reporter.step(f"{component} started (pid {proc.pid}), log: {log_path}")
        return record, proc

    def start_engine(self, claims: list[Claim]) -> tuple[Record, Any]:
        argv = get_engine(self.profile.engine.kind).launch_argv(self.profile)
        return self._spawn("engine", argv, engine_env(self.profile), self.profile.engine.port,
                           self.profile.engine.host, claims)

    def start_proxy(self, claims: list[Claim] | None, upstream: str) -> tuple[Record, Any]:
        if claims is None:
            try:
                claims = claim_components(HostLocks(), self.profile, self.state_dir, ["proxy"], f"up {self.name}")["proxy"]
            except ClaimConflict as exc:
                raise StartFailed(f"cannot restart the proxy: {exc}", ExitStatus.CONFLICT) from None
        try:
            argv = proxy_argv(self.profile, self.opts, self.key_args, upstream)
            return self._spawn("proxy", argv, dict(os.environ), self.profile.proxy.port, self.profile.proxy.host, claims)
        finally:
            release_all({"proxy": claims})

    def _proxy_exited(self, code: int, upstream: str) -> None:
        """The proxy died while the stack starts: restart it (bounded), keep the engine."""
        record, _ = self.proxy
        if self.proxy_restarts >= PROXY_RESTARTS:
            raise StartFailed(f"the proxy exited with code {code} during start-up, also after {PROXY_RESTARTS} "
                              f"restarts (log: {record.log})", ExitStatus.START_FAILED, tail(record.log, 80))
        self.proxy_restarts += 1
        self.reporter.step(f"the proxy exited with code {code} (log: {record.log}); restarting it "
                           f"({self.proxy_restarts} of {PROXY_RESTARTS}), the engine keeps running")
        stop(record, 5.0)
        remove_record(self.state_dir, self.name, "proxy")
        self.started = [r for r in self.started if r is not record]
        self.proxy = self.start_proxy(None, upstream)

    # waiting ----------------------------------------------------------------------------------
    def wait_engine(self, record: Record, proc, timeout: float) -> None:
        profile = self.profile
        engine = get_engine(profile.engine.kind)
        readiness = EngineReadiness(profile, engine, url=_url(record))
        start = time.monotonic()
        deadline = start + timeout
        while True:
            code = proc.poll()
            if code is not None:
                raise StartFailed(f"the engine exited with code {code} during start-up (log: {record.log})",
                                  ExitStatus.START_FAILED, tail(record.log, 80))
            if self.proxy is not None:
                pcode = self.proxy[1].poll()
                if pcode is not None:
                    self._proxy_exited(pcode, _url(record))
            probe = readiness.poll()
            if probe.state == "ready":
                self.reporter.step(f"engine ready after {time.monotonic() - start:.1f} s")
                return
            if probe.state == "adapters":
                stop(record, ENGINE_STOP_TIMEOUT_S)
                raise StartFailed(f"the engine is up but {probe.detail}; it was stopped", ExitStatus.ADAPTERS)
            now = time.monotonic()
            if now >= deadline:
                stop(record, ENGINE_STOP_TIMEOUT_S)
                raise StartFailed(f"the engine was not ready within {timeout:.0f} s ({probe.detail}); it was stopped "
                                  f"(log: {record.log})", ExitStatus.TIMEOUT, tail(record.log, 20))
            phase = engine.phase(tail(record.log, 50)) or "starting"
            self.reporter.waiting(now - start, timeout, phase, probe.detail)
            self.sleep(min(POLL_S, max(0.05, deadline - now)))

    def wait_proxy(self, upstream: str) -> None:
        deadline = time.monotonic() + PROXY_READY_TIMEOUT_S
        while True:
            record, proc = self.proxy
            code = proc.poll()
            if code is not None:
                self._proxy_exited(code, upstream)
                deadline = time.monotonic() + PROXY_READY_TIMEOUT_S
                continue
            if http_status(_url(record) + "/readyz") == 200:
                return
            if time.monotonic() >= deadline:
                raise StartFailed(f"the proxy was not ready within {PROXY_READY_TIMEOUT_S:.0f} s (log: {record.log})",
                                  ExitStatus.START_FAILED, tail(record.log, 80))
            self.sleep(0.1)

    # failure ----------------------------------------------------------------------------------
    def clean_up(self, exc: BaseException, adopted_engine: Record | None) -> None:
        """Stop what this invocation started (and an adopted engine that failed); a second Ctrl-C
        here is reported with what may still run and how to stop it."""
        interrupted = isinstance(exc, KeyboardInterrupt)
        if interrupted:
            _one_more_interrupt()
            self.reporter.step("interrupted: stopping what this command started (Ctrl-C again leaves it running)")
        try:
            for record in reversed(self.started):
                stop(record, 10.0)
                remove_record(self.state_dir, self.name, record.component)
            if isinstance(exc, StartFailed) and adopted_engine is not None:
                stop(adopted_engine, 10.0)
                remove_record(self.state_dir, self.name, "engine")
        except KeyboardInterrupt:
            left = [f"{r.component} (pid {r.pid})" for r in [*self.started, *([adopted_engine] if adopted_engine else [])]
                    if members(r)]
            what = ", ".join(left) or "nothing"
            raise MolctlError(f"interrupted again while stopping: still running: {what}; the engine may keep its GPUs "
                              f"and ports: run `molctl down {self.name}` to stop it", ExitStatus.INTERRUPTED) from None
        if interrupted:
            kept = " (the engine started earlier keeps running: molctl down stops it)" if adopted_engine else ""
            raise MolctlError(f"interrupted; everything this command started was stopped{kept}",
                              ExitStatus.INTERRUPTED) from None


def _one_more_interrupt() -> None:
    """During the clean-up after a Ctrl-C: the next Ctrl-C interrupts it once (and is reported);
    any further one is ignored, so it cannot cut the report or the exit short."""
    import signal

    def once(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGINT, once)
    except ValueError:  # not the main thread
        pass


def preflight(profile: Profile, state_dir: Path, opts: UpOptions, reporter: Reporter, probes_factory,
              consequence: str, extra_skip: Iterable[str] = (), own_profiles: Iterable[str] = ()) -> None:
    """The `check` categories (honouring --skip); a failure raises: exit 4 when the only failures
    are ports or GPUs held by someone else, else exit 3. The reporter shows only the failures
    and warnings; the error carries the whole report (for --json)."""
    from molctl.checks import run_checks
    from molctl.core import host_probes

    probes = host_probes(state_dir, profile.name, opts.api_key_file, probes_factory() if probes_factory else None,
                         own_profiles=own_profiles)
    report = run_checks(profile, probes, set(opts.skip) | set(extra_skip))
    if report.ok:
        return
    reporter.check_report(report)
    failed = [c for c in report.checks if c.status == "fail"]
    if all(c.id.startswith("port.") or c.id == "gpu.lock" for c in failed):
        raise PreflightFailed(f"{failed[0].detail}; {consequence}", ExitStatus.CONFLICT, report)
    raise PreflightFailed(f"preflight of {profile.name} failed: {len(failed)} check(s), first {failed[0].id}: "
                          f"{failed[0].detail}; {consequence}", ExitStatus.CHECK_FAILED, report)


def _result(profile: Profile, records: dict[str, Record], already: bool, timings: dict[str, float]) -> dict[str, Any]:
    proxy = records.get("proxy")
    endpoint = (_url(proxy) if proxy else base_url(profile.proxy.host, profile.proxy.port)) + "/v1"
    return {
        "profile": profile.name,
        "state": "ready",
        "already_running": already,
        "endpoint": endpoint,
        "model": profile.served_model_name,
        "components": {c: {"pid": r.pid, "port": r.port, "log": r.log} for c, r in records.items()},
        "timings": timings,
    }


def unreadable_records_error(state_dir: Path, name: str, problems: list[RecordProblem]) -> MolctlError:
    found = _marked_for(state_dir, name, problems)
    procs = ", ".join(f"pid {p.pid} ({_pname(p)})" for p, _ in found) or "none found"
    first = problems[0]
    return MolctlError(f"{name}: the {first.component} record {first.path} is unreadable ({first.error}); "
                       f"processes carrying its marker: {procs}; `molctl down {name} --force` stops them and "
                       f"removes the record", ExitStatus.CONFLICT)


def _marked_for(state_dir: Path, name: str, problems: list[RecordProblem]):
    paths = {os.path.realpath(p.path) for p in problems}
    return [(p, path) for p, path in marked_by_path(state_dir / name) if path in paths]


def _pname(proc) -> str:
    try:
        return proc.name()
    except Exception:  # noqa: BLE001 - gone meanwhile
        return "?"


def known_or_recorded(ctx, name: str) -> None:
    """An unknown profile name (a typo) is exit 3 listing the known ones, unless records of it exist."""
    try:
        if (ctx.state_dir / name).is_dir():
            return
    except OSError:
        return
    dirs = ctx.dirs()
    if name not in profile_files(dirs):
        raise stackconfig.unknown_profile(name, dirs)


# --------------------------------------------------------------------------------------------- down

def _every(timeout_s: float) -> float:
    return 10.0 if timeout_s >= 30 else max(1.0, timeout_s / 3)


def down(ctx, name: str | None, drain_timeout_s: float, force: bool, say: Callable[[str], None],
         engine_timeout_s: float = ENGINE_STOP_TIMEOUT_S, gpu_probe=None,
         warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    state_dir = ctx.state_dir
    warn = warn or say
    if name:
        known_or_recorded(ctx, name)
    if not state_dir.exists():
        return {"stopped": [], "message": "nothing is running"}
    lock = StateLock(state_dir, f"down {name or ''}".strip())
    try:
        lock.__enter__()
    except StateDirError as exc:
        warn(f"{exc}; stopping what the records and markers name without it")
        lock = None
    try:
        return _down_locked(state_dir, [name] if name else None, drain_timeout_s, engine_timeout_s, force, say, warn,
                            gpu_probe)
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


def _down_locked(state_dir: Path, names: list[str] | None, drain_s: float, engine_s: float, force: bool, say, warn,
                 gpu_probe) -> dict[str, Any]:
    listed = names if names is not None else profiles_with_records(state_dir)
    stopped = []
    for n in listed:
        records, problems = read_records_checked(state_dir, n)
        if not records and not problems:
            continue
        if problems:
            stopped.append(_down_unreadable(state_dir, n, problems, drain_s, engine_s, force, say, warn))
        if records:
            stopped.append(_down_one(state_dir, n, drain_s, engine_s, force, say, warn, gpu_probe))
    if names is None:
        stopped += _down_unlisted(state_dir, {s["profile"] for s in stopped}, drain_s, engine_s, say, warn)
    if not stopped:
        return {"stopped": [], "message": "nothing is running"}
    profiles = list(dict.fromkeys(s["profile"] for s in stopped))
    return {"stopped": stopped, "message": f"stopped {', '.join(profiles)}"}


def _down_unlisted(state_dir: Path, done: set[str], drain_s: float, engine_s: float, say, warn) -> list[dict]:
    """Processes carrying a marker of this state dir whose record cannot even be listed (a state
    dir that cannot be read): the marker proves they are ours, so they are stopped, with a warning."""
    groups: dict[tuple[str, str], list] = {}
    root = os.path.realpath(state_dir).rstrip("/") + "/"
    for proc, path in marked_by_path(state_dir):
        rel = path[len(root):].split("/")
        if len(rel) != 2 or rel[0] in done:
            continue
        groups.setdefault((rel[0], rel[1].removesuffix(".json")), []).append(proc)
    out: dict[str, dict] = {}
    for (profile, component), procs in sorted(groups.items(), key=lambda kv: kv[0][1] != "proxy"):
        warn(f"{profile} {component}: no readable record, but {len(procs)} process(es) carry its marker; stopping them")
        result = stop_processes(None, procs, drain_s if component == "proxy" else engine_s)
        entry = out.setdefault(profile, {"profile": profile, "components": {}})
        entry["components"][component] = "killed" if result.killed else "stopped"
        if not result.ok:
            warn(f"{profile} {component}: process(es) survived SIGKILL: {', '.join(result.survivors)}")
    return list(out.values())


def _down_unreadable(state_dir: Path, name: str, problems: list[RecordProblem], drain_s: float, engine_s: float,
                     force: bool, say, warn) -> dict:
    """A corrupt or unreadable record: report it; find its processes by their marker; stop them
    and remove the record only with --force."""
    found = _marked_for(state_dir, name, problems)
    if not force:
        raise unreadable_records_error(state_dir, name, problems)
    out: dict[str, Any] = {"profile": name, "components": {}}
    for problem in sorted(problems, key=lambda p: p.component != "proxy"):
        procs = [p for p, path in found if path == os.path.realpath(problem.path)]
        warn(f"{name} {problem.component}: record {problem.path} is unreadable ({problem.error}); "
             f"--force: stopping the {len(procs)} process(es) carrying its marker")
        result = stop_processes(None, procs, drain_s if problem.component == "proxy" else engine_s)
        if not result.ok:
            raise MolctlError(f"{name} {problem.component}: process(es) survived SIGKILL: {', '.join(result.survivors)}")
        _remove(state_dir, name, problem.component, warn)
        out["components"][problem.component] = "killed" if result.killed else ("stopped" if procs else "not running")
    return out


def _remove(state_dir: Path, name: str, component: str, warn) -> None:
    try:
        path = record_path(state_dir, name, component)
        if path.exists() or path.is_symlink():
            path.unlink()
    except OSError as exc:
        warn(f"could not remove the {component} record {record_path(state_dir, name, component)}: "
             f"{exc.strerror or exc} (its processes are gone; remove it by hand)")


def _down_one(state_dir: Path, name: str, drain_s: float, engine_s: float, force: bool, say, warn, gpu_probe) -> dict:
    records = read_records(state_dir, name)
    out: dict[str, Any] = {"profile": name, "components": {}}
    pids = stack_pids(state_dir, name)
    kept = False
    for component in ("proxy", "engine"):  # proxy first: it drains in-flight requests
        record = records.get(component)
        if record is None:
            continue
        timeout = drain_s if component == "proxy" else engine_s
        if not members(record):
            if process_state(record) == "uncertain" and not force:
                warn(f"{name} {component}: pid {record.pid} runs but cannot be verified as the recorded process "
                     f"(a record of an older molctl); not signalled, record kept (--force removes it)")
                out["components"][component] = "unverified"
                kept = True
                continue
            say(f"{name} {component}: not running; removing its record")
            _remove(state_dir, name, component, warn)
            out["components"][component] = "not running"
            continue
        say(f"{name} {component}: stopping (pid {record.pid}, up to {timeout:.0f} s, then SIGKILL)")
        result = stop(record, timeout, on_escalate=lambda c=component: say(f"{name} {c}: still running; sending SIGKILL"),
                      on_wait=lambda left, c=component: say(f"{name} {c}: still running; SIGKILL in {left:.0f} s"),
                      wait_every_s=_every(timeout))
        if not result.ok and not force:
            raise MolctlError(f"{name} {component}: process(es) survived SIGKILL: {', '.join(result.survivors)}; "
                              f"record kept in {state_dir / name} (--force removes it anyway)")
        out["components"][component] = "killed" if result.killed else "stopped"
        if component == "proxy":
            _remove(state_dir, name, component, warn)
    if kept:
        return out
    leftover = _gpu_leftovers(pids, gpu_probe)
    if leftover and not force:
        raise MolctlError(f"{name}: NVML still shows process(es) of the stack on the GPUs: {', '.join(leftover)}; "
                          f"engine record kept in {state_dir / name} (--force removes it anyway)")
    engine = records.get("engine")
    if engine is not None and members(engine) and not force:  # never drop a record while a process it names runs
        raise MolctlError(f"{name} engine: still running after the stop; record kept (--force removes it anyway)")
    if engine is not None:
        _remove(state_dir, name, "engine", warn)  # only now: nothing of the stack survives, on the GPUs either
    return out


def _gpu_leftovers(pids: set[int], gpu_probe) -> list[str]:
    from molctl.probes import GpuUnavailable, NvmlProbe

    probe = gpu_probe or NvmlProbe()
    try:
        inventory = probe.inventory()
    except GpuUnavailable:
        return []
    return [f"GPU {d.index} pid {p.pid} {p.name}" for d in inventory.devices for p in d.processes if p.pid in pids]


# --------------------------------------------------------------------------------------------- status

def status(ctx, name: str | None, gpu_probe=None) -> dict[str, Any]:
    state_dir = ctx.state_dir
    if name:
        known_or_recorded(ctx, name)
    names = [name] if name else profiles_with_records(state_dir)
    holder = lock_holder(state_dir) if state_dir.exists() else None
    stacks = []
    for n in names:
        records, problems = read_records_checked(state_dir, n)
        profile = stackconfig.profile_from(recorded_config(records))
        if profile is None:
            try:
                profile = load_profile(n, ctx.dirs())
            except ProfileError:
                profile = None
        stacks.append(_stack_status(state_dir, n, profile, records, problems, holder, gpu_probe))
    return {"stacks": stacks}


def _stack_status(state_dir: Path, name: str, profile: Profile | None, records: dict[str, Record],
                  problems: list[RecordProblem], holder: dict | None, gpu_probe) -> dict:
    """Probe from the records (the host and port actually used, overrides included); the profile
    is the one recorded at the start."""
    components = []
    now = time.time()
    paths = {"engine": "/health", "proxy": "/readyz"}
    for component in COMPONENTS:
        record = records.get(component)
        if record is None:
            continue
        alive = is_same_process(record)
        health = http_status(_url(record) + paths[component], timeout=1.0) if alive else None
        components.append({"name": component, "pid": record.pid, "alive": alive, "port": record.port,
                           "health": health, "log": record.log, "uptime_s": round(now - record.started_at, 1) if alive else None})
    engine_ok = any(c["name"] == "engine" and c["health"] == 200 for c in components)
    adapters = _adapter_status(profile, records.get("engine")) if engine_ok else None
    state = _state_of(name, records, components, holder)
    if state == "ready" and adapters not in (None, "ok"):
        state = "degraded"
    out: dict[str, Any] = {"profile": name, "state": state, "components": components}
    if problems:
        marked = _marked_for(state_dir, name, problems)
        out["problems"] = [f"{p.component} record {p.path} is unreadable ({p.error}); "
                           f"{len([m for m in marked if m[1] == os.path.realpath(p.path)])} process(es) carry its marker"
                           for p in problems]
        out["state"] = "degraded" if marked or any(c["alive"] for c in components) else "failed"
    if adapters is not None:
        out["adapters"] = adapters
    if "proxy" in records:
        out["endpoint"] = _url(records["proxy"]) + "/v1"
    if profile is not None:
        out["model"] = profile.served_model_name
    gpus = _gpu_usage(state_dir, name, gpu_probe) if out["state"] != "stopped" else []
    if gpus:
        out["gpus"] = gpus
    return out


def _adapter_status(profile: Profile | None, record: Record | None) -> str | None:
    """'ok' when the live engine lists L0-L3 under the expected parent, else what is wrong."""
    from molctl.engines.base import adapter_problems

    if profile is None or record is None:
        return None
    try:
        import httpx

        models = httpx.get(_url(record) + "/v1/models", timeout=2.0, trust_env=False).json()
    except (httpx.HTTPError, ValueError):
        return "/v1/models not answering"
    problems = adapter_problems(profile, get_engine(profile.engine.kind), models)
    return "; ".join(problems) if problems else "ok"


def _state_of(name: str, records: dict, components: list[dict], holder: dict | None) -> str:
    """The states of ARCHITECTURE.md: stopped|starting|ready|degraded|stopping|failed."""
    if not records:
        return "stopped"
    command = str((holder or {}).get("command", ""))
    if command.startswith("down"):
        return "stopping"
    if command in (f"up {name}", f"switch {name}"):
        return "starting"
    alive = [c for c in components if c["alive"]]
    if not alive:
        return "failed"
    healthy = [c for c in components if c["alive"] and c["health"] == 200]
    if len(healthy) == len(COMPONENTS):
        return "ready"
    return "degraded"


def _gpu_usage(state_dir: Path, name: str, gpu_probe) -> list[dict]:
    from molctl.probes import GpuUnavailable, NvmlProbe

    try:
        inventory = (gpu_probe or NvmlProbe()).inventory()
    except GpuUnavailable:
        return []
    pids = stack_pids(state_dir, name)
    out = []
    for d in inventory.devices:
        used = sum(p.used_bytes or 0 for p in d.processes if p.pid in pids)
        if used:
            out.append({"index": d.index, "used_bytes": used, "total_bytes": d.total_bytes})
    return out


# --------------------------------------------------------------------------------------------- switch

def switch(name: str, ctx, opts: UpOptions, reporter: Reporter, drain_timeout_s: float,
           probes_factory=None, sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Drain and stop whatever runs, then `up` the profile, holding the state lock throughout
    (no other `up` can start in between). If the new profile fails its preflight (checked without
    the port category, since the old stack holds the ports), nothing is stopped. If the new stack
    fails after the old one was stopped, the error says so and names the command that brings the
    old one back."""
    profile, config = stackconfig.load(name, ctx.dirs(), opts.overrides)
    key_args = resolve_key_option(opts)
    state_dir = ctx.state_dir
    ensure_state_dir(state_dir)
    with StateLock(state_dir, f"switch {name}"):
        running = running_profiles(state_dir)
        preflight(profile, state_dir, opts, reporter, probes_factory, "the running stack was left alone",
                  extra_skip={"port"}, own_profiles=running)
        back = {p: recorded_config(read_records(state_dir, p)).get("up_command") or f"molctl up {p}"
                for p in running if p != name}
        t0 = time.monotonic()
        stopped = _down_locked(state_dir, running, drain_timeout_s, opts.stop_timeout_s, False, reporter.step,
                               reporter.step, None) if running else None
        t_down = time.monotonic() - t0
        try:
            result = _up_locked(profile, config, ctx, opts, key_args, reporter, probes_factory, sleep)
        except MolctlError as exc:
            if back:
                how = "; ".join(f"the old stack {p} was stopped: bring it back with `{cmd}`" for p, cmd in back.items())
                exc.args = (f"{exc}; {how}",)
            raise
    result["timings"] = {**result.get("timings", {}), "stop_s": round(t_down, 2)}
    result["stopped"] = [s["profile"] for s in (stopped or {}).get("stopped", [])]
    return result
