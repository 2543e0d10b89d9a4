"""up / down / switch / status: the stack's lifecycle over records in the state dir.

Every mutating command holds the state lock. A component is recorded right after it is spawned
(pid, pgid, create time, argv, port, log), so a molctl that dies mid-start leaves a record the
next command can clean. Records are removed only once no process of the component survives.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from molctl.engines import get_engine
from molctl.errors import ConflictError, ExitStatus, MolctlError, ProfileError
from molctl.processes import members, record_for, spawn, stack_pids, stop, tail
from molctl.profiles import Profile, load_profile
from molctl.readiness import EngineReadiness, engine_url, http_status, proxy_url
from molctl.state import (COMPONENTS, Record, StateLock, ensure_state_dir, is_same_process, lock_holder, new_log_path,
                          profiles_with_records, read_records, remove_record, write_record)

POLL_S = 0.5  # "about once a second" or better: a refused connect costs nothing
ENGINE_STOP_TIMEOUT_S = 60.0
PROXY_READY_TIMEOUT_S = 60.0


class StartFailed(MolctlError):
    """The engine or proxy exited, timed out or lacks adapters during start-up."""

    def __init__(self, message: str, exit_status: ExitStatus, log_tail: list[str] | None = None):
        super().__init__(message, exit_status)
        self.log_tail = log_tail or []


@dataclass
class UpOptions:
    overrides: list[tuple[str, Any]] = field(default_factory=list)
    skip: Iterable[str] = ()
    timeout_s: float | None = None
    api_key_file: Path | None = None
    allow_unauthenticated: bool = False
    drain_timeout_s: float = 600.0
    profiles_dirs: list[Path] = field(default_factory=list)


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
    """Stop what is left of this profile's recorded components (ours by pgid + create time)
    and remove their records. A pid now owned by an unrelated process is never signalled."""
    for component, record in read_records(state_dir, name).items():
        _clean_component(state_dir, name, component, record, say)


def _clean_component(state_dir: Path, name: str, component: str, record: Record, say: Callable[[str], None]) -> None:
    procs = members(record)
    if procs:
        say(f"cleaning up {len(procs)} leftover process(es) of the {component} (pgid {record.pgid})")
        result = stop(record, 10.0)
        if not result.ok:
            raise MolctlError(f"could not stop leftover {component} processes: {', '.join(result.survivors)}")
    elif not is_same_process(record) and _pid_exists(record.pid):
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
    return [p for p in profiles_with_records(state_dir) if stack_pids(state_dir, p)]


def stack_ready(profile: Profile, records: dict[str, Record]) -> bool:
    if set(records) != set(COMPONENTS) or not all(is_same_process(r) for r in records.values()):
        return False
    return http_status(engine_url(profile) + "/health") == 200 and http_status(proxy_url(profile) + "/readyz") == 200


def resolve_key_option(opts: UpOptions) -> list[str]:
    """Proxy argv for the key: the file's path, or nothing when MOLCTL_API_KEY travels in the
    environment; validated (file readable, holding a key) before anything starts."""
    from molctl.keys import resolve_api_keys

    keys = resolve_api_keys(opts.api_key_file, opts.allow_unauthenticated)
    if opts.api_key_file is not None:
        return ["--api-key-file", str(opts.api_key_file.resolve())]
    return [] if keys else ["--allow-unauthenticated"]


def proxy_argv(profile: Profile, opts: UpOptions) -> list[str]:
    argv = [sys.executable, "-m", "molctl"]
    for d in opts.profiles_dirs:
        argv += ["--profiles-dir", str(Path(d).resolve())]
    argv += ["proxy", profile.name, "--upstream", engine_url(profile), "--host", profile.proxy.host,
             "--port", str(profile.proxy.port), "--drain-timeout", str(opts.drain_timeout_s)]
    for key, value in opts.overrides:
        argv += ["--set", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    return argv + resolve_key_option(opts)


def up(name: str, ctx, opts: UpOptions, reporter: Reporter, probes_factory=None,
       sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Start the stack; returns the result object (see README). Raises MolctlError subclasses."""
    state_dir = ctx.state_dir
    profile = load_profile(name, ctx.dirs(), opts.overrides)
    key_args = resolve_key_option(opts)  # fail on a missing key before anything starts
    ensure_state_dir(state_dir)
    t0 = time.monotonic()
    with StateLock(state_dir, f"up {name}"):
        others = [p for p in running_profiles(state_dir) if p != name]
        if others:
            raise ConflictError(f"profile {others[0]} is running on this host; use `molctl switch {name}` to replace it")
        records = read_records(state_dir, name)
        if records and stack_ready(profile, records):
            reporter.step(f"profile {name} is already running and ready")
            return _result(profile, read_records(state_dir, name), already=True, timings={})
        live = {c: r for c, r in records.items() if is_same_process(r)}
        if "engine" in live:
            # An earlier `up` that died (terminal closed, molctl killed) left its engine loading:
            # wait for it rather than throw an hour of loading away. Stop only what is stale.
            reporter.step(f"the {name} engine started earlier is still running (pid {live['engine'].pid}); "
                          "waiting for it instead of restarting it")
            stale = {c: r for c, r in records.items() if c not in live}
            for component in stale:
                _clean_component(state_dir, name, component, records[component], reporter.step)
        elif records:
            clean_stale(state_dir, name, reporter.step)
            live = {}

        reporter.step(f"preflight checks for {name}")
        preflight(profile, state_dir, opts, reporter, probes_factory, "nothing was started")

        started: list[Record] = []
        try:
            if "engine" in live:
                engine_record, engine_proc = live["engine"], Adopted(live["engine"])
            else:
                engine_record, engine_proc = _start_engine(profile, state_dir, reporter)
                started.append(engine_record)
            # The proxy starts while the engine loads (its /readyz stays 503 until the engine
            # serves), so its own start-up is off the critical path.
            if "proxy" in live:
                proxy_record, proxy_proc = live["proxy"], Adopted(live["proxy"])
            else:
                proxy_record, proxy_proc = _start_proxy(profile, opts, key_args, state_dir, reporter)
                started.append(proxy_record)
            timeout = opts.timeout_s if opts.timeout_s is not None else profile.engine.start_timeout_s
            _wait_engine(profile, engine_record, engine_proc, timeout, reporter, sleep, watch=(proxy_record, proxy_proc))
            t_engine = time.monotonic() - t0
            _wait_proxy(profile, proxy_record, proxy_proc, sleep)
        except BaseException as exc:
            for record in reversed(started):
                stop(record, 10.0)
                remove_record(state_dir, name, record.component)
            if isinstance(exc, StartFailed) and "engine" in live:  # a failed adopted engine is stopped too
                stop(live["engine"], 10.0)
                remove_record(state_dir, name, "engine")
            if isinstance(exc, KeyboardInterrupt):
                kept = " (the engine started earlier keeps running: molctl down stops it)" if "engine" in live else ""
                raise MolctlError(f"interrupted; everything this command started was stopped{kept}",
                                  ExitStatus.INTERRUPTED) from None
            raise
        total = time.monotonic() - t0
        return _result(profile, read_records(state_dir, name), already=False,
                       timings={"engine_ready_s": round(t_engine, 2), "total_s": round(total, 2)})


def preflight(profile: Profile, state_dir: Path, opts: UpOptions, reporter: Reporter, probes_factory,
              consequence: str, extra_skip: Iterable[str] = ()) -> None:
    """The `check` categories (honouring --skip); a failure raises: exit 4 when the only failures
    are ports held by a foreign process, else exit 3."""
    from molctl.checks import run_checks
    from molctl.core import host_probes

    probes = host_probes(state_dir, profile.name, opts.api_key_file, probes_factory() if probes_factory else None)
    report = run_checks(profile, probes, set(opts.skip) | set(extra_skip))
    if report.ok:
        return
    reporter.check_report(report)
    failed = [c for c in report.checks if c.status == "fail"]
    if all(c.id.startswith("port.") for c in failed):
        raise ConflictError(f"{failed[0].detail}; {consequence}")
    raise ProfileError(f"preflight of {profile.name} failed: {len(failed)} check(s), first {failed[0].id}: "
                       f"{failed[0].detail}; {consequence}")


def _start_engine(profile: Profile, state_dir: Path, reporter: Reporter):
    engine = get_engine(profile.engine.kind)
    argv = engine.launch_argv(profile)
    log_path = new_log_path(state_dir, profile.name, "engine")
    proc = spawn(argv, engine_env(profile), log_path)
    record = record_for("engine", proc, argv, profile.engine.port, log_path)
    write_record(state_dir, profile.name, record)
    reporter.step(f"engine started (pid {proc.pid}), log: {log_path}")
    return record, proc


def _wait_engine(profile: Profile, record: Record, proc, timeout: float, reporter: Reporter, sleep,
                 watch: tuple[Record, Any] | None = None) -> None:
    engine = get_engine(profile.engine.kind)
    readiness = EngineReadiness(profile, engine)
    start = time.monotonic()
    deadline = start + timeout
    while True:
        code = proc.poll()
        if code is not None:
            raise StartFailed(f"the engine exited with code {code} during start-up (log: {record.log})",
                              ExitStatus.START_FAILED, tail(record.log, 80))
        if watch is not None and watch[1].poll() is not None:
            raise StartFailed(f"the proxy exited with code {watch[1].poll()} during start-up (log: {watch[0].log})",
                              ExitStatus.START_FAILED, tail(watch[0].log, 80))
        probe = readiness.poll()
        if probe.state == "ready":
            reporter.step(f"engine ready after {time.monotonic() - start:.1f} s")
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
        reporter.waiting(now - start, timeout, phase, probe.detail)
        sleep(min(POLL_S, max(0.05, deadline - now)))


def _start_proxy(profile: Profile, opts: UpOptions, key_args: list[str], state_dir: Path, reporter: Reporter):
    argv = proxy_argv(profile, opts)
    log_path = new_log_path(state_dir, profile.name, "proxy")
    env = dict(os.environ)
    proc = spawn(argv, env, log_path)
    record = record_for("proxy", proc, argv, profile.proxy.port, log_path)
    write_record(state_dir, profile.name, record)
    reporter.step(f"proxy started (pid {proc.pid}), log: {log_path}")
    return record, proc


def _wait_proxy(profile: Profile, record: Record, proc, sleep) -> None:
    deadline = time.monotonic() + PROXY_READY_TIMEOUT_S
    url = proxy_url(profile) + "/readyz"
    while True:
        code = proc.poll()
        if code is not None:
            raise StartFailed(f"the proxy exited with code {code} during start-up (log: {record.log})",
                              ExitStatus.START_FAILED, tail(record.log, 80))
        if http_status(url) == 200:
            return
        if time.monotonic() >= deadline:
            raise StartFailed(f"the proxy was not ready within {PROXY_READY_TIMEOUT_S:.0f} s (log: {record.log})",
                              ExitStatus.START_FAILED, tail(record.log, 80))
        sleep(0.1)


def _result(profile: Profile, records: dict[str, Record], already: bool, timings: dict[str, float]) -> dict[str, Any]:
    return {
        "profile": profile.name,
        "state": "ready",
        "already_running": already,
        "endpoint": proxy_url(profile) + "/v1",
        "model": profile.served_model_name,
        "components": {c: {"pid": r.pid, "port": r.port, "log": r.log} for c, r in records.items()},
        "timings": timings,
    }


# --------------------------------------------------------------------------------------------- down

def down(ctx, name: str | None, drain_timeout_s: float, force: bool, say: Callable[[str], None],
         engine_timeout_s: float = ENGINE_STOP_TIMEOUT_S, gpu_probe=None) -> dict[str, Any]:
    state_dir = ctx.state_dir
    if not state_dir.exists():
        return {"stopped": [], "message": "nothing is running"}
    with StateLock(state_dir, f"down {name or ''}".strip()):
        names = [name] if name else profiles_with_records(state_dir)
        names = [n for n in names if read_records(state_dir, n)]
        if not names:
            return {"stopped": [], "message": "nothing is running"}
        stopped = []
        for n in names:
            stopped.append(_down_one(state_dir, n, drain_timeout_s, engine_timeout_s, force, say, gpu_probe))
        return {"stopped": stopped, "message": f"stopped {', '.join(s['profile'] for s in stopped)}"}


def _down_one(state_dir: Path, name: str, drain_s: float, engine_s: float, force: bool, say, gpu_probe) -> dict:
    records = read_records(state_dir, name)
    out: dict[str, Any] = {"profile": name, "components": {}}
    pids = stack_pids(state_dir, name)
    for component in ("proxy", "engine"):  # proxy first: it drains in-flight requests
        record = records.get(component)
        if record is None:
            continue
        timeout = drain_s if component == "proxy" else engine_s
        if not members(record):
            say(f"{name} {component}: not running; removing its record")
            remove_record(state_dir, name, component)
            out["components"][component] = "not running"
            continue
        say(f"{name} {component}: stopping (pid {record.pid}, up to {timeout:.0f} s)")
        result = stop(record, timeout, on_escalate=lambda c=component: say(f"{name} {c}: still running; sending SIGKILL"))
        if not result.ok and not force:
            raise MolctlError(f"{name} {component}: process(es) survived SIGKILL: {', '.join(result.survivors)}; "
                              f"record kept in {state_dir / name} (--force removes it anyway)")
        out["components"][component] = "killed" if result.killed else "stopped"
        if component == "proxy":
            remove_record(state_dir, name, component)
    leftover = _gpu_leftovers(pids, gpu_probe)
    if leftover and not force:
        raise MolctlError(f"{name}: NVML still shows process(es) of the stack on the GPUs: {', '.join(leftover)}; "
                          f"engine record kept in {state_dir / name} (--force removes it anyway)")
    remove_record(state_dir, name, "engine")  # only now: nothing of the stack survives, on the GPUs either
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
    names = [name] if name else profiles_with_records(state_dir)
    holder = lock_holder(state_dir) if state_dir.exists() else None
    stacks = []
    for n in names:
        records = read_records(state_dir, n)
        try:
            profile = load_profile(n, ctx.dirs())
        except ProfileError:
            profile = None
        stacks.append(_stack_status(state_dir, n, profile, records, holder, gpu_probe))
    return {"stacks": stacks}


def _stack_status(state_dir: Path, name: str, profile: Profile | None, records: dict[str, Record], holder: str | None,
                  gpu_probe) -> dict:
    """Probe from the records (the ports actually used, overrides included), not the profile file."""
    from molctl.readiness import connect_host

    components = []
    now = time.time()
    hosts = {"engine": profile.engine.host, "proxy": profile.proxy.host} if profile else {}
    paths = {"engine": "/health", "proxy": "/readyz"}
    for component in COMPONENTS:
        record = records.get(component)
        if record is None:
            continue
        alive = is_same_process(record)
        base = f"http://{connect_host(hosts.get(component, '127.0.0.1'))}:{record.port}"
        health = http_status(base + paths[component], timeout=1.0) if alive else None
        components.append({"name": component, "pid": record.pid, "alive": alive, "port": record.port,
                           "health": health, "log": record.log, "uptime_s": round(now - record.started_at, 1) if alive else None})
    adapters = _adapter_status(profile, records.get("engine"), base_host=hosts.get("engine", "127.0.0.1")) \
        if any(c["name"] == "engine" and c["health"] == 200 for c in components) else None
    state = _state_of(name, records, components, holder)
    if state == "ready" and adapters not in (None, "ok"):
        state = "degraded"
    out: dict[str, Any] = {"profile": name, "state": state, "components": components}
    if adapters is not None:
        out["adapters"] = adapters
    if "proxy" in records:
        out["endpoint"] = f"http://{connect_host(hosts.get('proxy', '127.0.0.1'))}:{records['proxy'].port}/v1"
    if profile is not None:
        out["model"] = profile.served_model_name
    gpus = _gpu_usage(state_dir, name, gpu_probe) if state != "stopped" else []
    if gpus:
        out["gpus"] = gpus
    return out


def _adapter_status(profile: Profile | None, record: Record | None, base_host: str) -> str | None:
    """'ok' when the live engine lists L0-L3 under the expected parent, else what is wrong."""
    from molctl.engines.base import adapter_problems
    from molctl.readiness import connect_host

    if profile is None or record is None:
        return None
    try:
        import httpx

        models = httpx.get(f"http://{connect_host(base_host)}:{record.port}/v1/models", timeout=2.0, trust_env=False).json()
    except (httpx.HTTPError, ValueError):
        return "/v1/models not answering"
    problems = adapter_problems(profile, get_engine(profile.engine.kind), models)
    return "; ".join(problems) if problems else "ok"


def _state_of(name: str, records: dict, components: list[dict], holder: str | None) -> str:
    """The states of ARCHITECTURE.md: stopped|starting|ready|degraded|stopping|failed."""
    if not records:
        return "stopped"
    if holder and "(molctl down" in holder:
        return "stopping"
    if holder and (f"(molctl up {name})" in holder or f"(molctl switch {name})" in holder):
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
           probes_factory=None) -> dict[str, Any]:
    """Drain and stop whatever runs, then `up` the profile. If the new profile fails its
    preflight (checked without the port category, since the old stack holds the ports), nothing
    is stopped."""
    profile = load_profile(name, ctx.dirs(), opts.overrides)
    resolve_key_option(opts)
    preflight(profile, ctx.state_dir, opts, reporter, probes_factory, "the running stack was left alone", extra_skip={"port"})
    t0 = time.monotonic()
    running = running_profiles(ctx.state_dir) if ctx.state_dir.exists() else []
    stopped = down(ctx, None, drain_timeout_s, False, reporter.step) if running else None
    t_down = time.monotonic() - t0
    result = up(name, ctx, opts, reporter, probes_factory)
    result["timings"] = {**result.get("timings", {}), "stop_s": round(t_down, 2)}
    result["stopped"] = [s["profile"] for s in (stopped or {}).get("stopped", [])]
    return result
