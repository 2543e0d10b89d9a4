"""`molctl down`, and stopping what an earlier stack left behind (used by `up` and `switch`).

The proxy stops first (it drains in-flight requests), then the engine's processes (SIGTERM,
a countdown, SIGKILL). The proxy is given its drain timeout plus PROXY_EXIT_GRACE_S before any
SIGKILL: at its deadline it answers what is still running (503 `draining`) and writes its queued
state, and that must not be cut short by a kill at the same deadline. Only processes proven ours are signalled (`molctl.processes`), and a
record is removed only once no process it names survives, on the GPUs either. A record that
cannot be read is reported, and its processes (found by their marker) are stopped only with
--force."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from molctl.errors import ConflictError, MolctlError
from molctl.lifecycle.progress import Progress
from molctl.lifecycle.stacks import known_or_recorded, marked_for, unreadable_records_error, unrecorded_marked
from molctl.processes import members, stack_pids, stop, stop_processes
from molctl.state import (
    Record,
    RecordProblem,
    StateDirError,
    StateLock,
    check_own_state_dir,
    ensure_state_dir,
    liveness,
    profiles_with_records,
    read_records,
    read_records_checked,
    record_path,
    remove_record,
)

ENGINE_STOP_TIMEOUT_S = 60.0
# after the drain deadline: the proxy's answers to what was still running, its final state writes and
# uvicorn's own graceful-shutdown timer (5 s), before `down` sends SIGKILL
PROXY_EXIT_GRACE_S = 10.0


def proxy_stop_timeout(drain_s: float) -> float:
    """How long `down` waits for a proxy given `drain_s` to drain before SIGKILL."""
    return drain_s + PROXY_EXIT_GRACE_S


def clean_stale(state_dir: Path, name: str, progress: Progress) -> None:
    """Stop what is left of this profile's recorded components (ours by identity or marker) and
    remove their records. A pid now owned by an unrelated process is never signalled."""
    for component, record in read_records(state_dir, name).items():
        clean_component(state_dir, name, component, record, progress)


def clean_component(state_dir: Path, name: str, component: str, record: Record, progress: Progress) -> None:
    """Stop what is left of one recorded component (ours by identity or marker), remove its record."""
    procs = members(record)
    if procs:
        progress.step(f"cleaning up {len(procs)} leftover process(es) of the {component} (pid {record.pid})")
        result = stop(record, 10.0)
        if not result.ok:
            raise MolctlError(f"could not stop leftover {component} processes: {', '.join(result.survivors)}")
    elif liveness(record) == "uncertain":
        raise ConflictError(
            f"the {component} record of {name} names pid {record.pid}, which runs but cannot be "
            f"verified as the recorded process; it is not touched: check it, then "
            f"`molctl down {name} --force` removes the record"
        )
    elif _pid_exists(record.pid):
        progress.step(f"stale {component} record: pid {record.pid} now belongs to another process; not touching it")
    remove_record(state_dir, name, component)


def _pid_exists(pid: int) -> bool:
    """A live process has this pid: a zombie (the recorded process, dead and not reaped yet by a
    parent or container init that reaps slowly) is no other process."""
    import psutil

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def _every(timeout_s: float) -> float:
    return 10.0 if timeout_s >= 30 else max(1.0, timeout_s / 3)


def down(
    ctx,
    name: str | None,
    drain_timeout_s: float,
    force: bool,
    progress: Progress,
    engine_timeout_s: float = ENGINE_STOP_TIMEOUT_S,
    gpu_probe=None,
) -> dict[str, Any]:
    """Stop one profile's stack (or every recorded one) under the state lock; returns
    {"stopped": [{"profile", "components": {component: state}}], "message"}. A state lock that
    cannot be taken (an unusable state dir) is a warning: what can be found is still stopped."""
    state_dir = ctx.state_dir
    if name:
        known_or_recorded(ctx, name)
    if not state_dir.exists():
        # deleted under a running stack (`rm -rf`)? Its processes still carry markers naming it
        left = unrecorded_marked(state_dir, [name] if name else None)
        if not left:
            return {"stopped": [], "message": "nothing is running"}
        progress.warn(
            f"state dir {state_dir} does not exist, but {sum(len(p) for p in left.values())} process(es) "
            f"carry markers pointing into it (it was deleted under them?); stopping them"
        )
        try:
            ensure_state_dir(state_dir)  # for the lock: an `up` taking it meanwhile is not raced
        except StateDirError:
            pass  # the lock cannot be taken below: a warning, the processes are still stopped
    check_own_state_dir(state_dir)  # another user's records could name any pid
    lock = StateLock(state_dir, "down", name)
    try:
        lock.__enter__()
    except StateDirError as exc:
        progress.warn(f"{exc}; stopping what the records and markers name without it")
        lock = None
    try:
        return down_locked(
            state_dir, [name] if name else None, drain_timeout_s, engine_timeout_s, force, progress, gpu_probe
        )
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


def down_locked(
    state_dir: Path,
    names: list[str] | None,
    drain_s: float,
    engine_s: float,
    force: bool,
    progress: Progress,
    gpu_probe=None,
) -> dict[str, Any]:
    listed = names if names is not None else profiles_with_records(state_dir)
    stopped = []
    for n in listed:
        records, problems = read_records_checked(state_dir, n)
        if not records and not problems:
            continue
        if problems and not force:  # before anything is stopped
            raise unreadable_records_error(state_dir, n, problems)
        parts = []
        if problems:
            parts.append(
                lambda n=n, problems=problems: _down_unreadable(
                    state_dir, n, problems, drain_s, engine_s, force, progress
                )
            )
        if records:
            parts.append(lambda n=n: down_one(state_dir, n, drain_s, engine_s, force, progress, gpu_probe))
        if records and problems and "proxy" in records:
            parts.reverse()  # the proxy's record is the readable one: it drains before the engine stops
        entry: dict[str, Any] = {"profile": n, "components": {}}  # one entry per stack
        for part in parts:
            entry["components"].update(part()["components"])
        stopped.append(entry)
    for extra in _down_unlisted(state_dir, names, drain_s, engine_s, progress):
        same = [s for s in stopped if s["profile"] == extra["profile"]]
        if same:
            same[-1]["components"].update(extra["components"])
        else:
            stopped.append(extra)
    if not stopped:
        return {"stopped": [], "message": "nothing is running"}
    profiles = list(dict.fromkeys(s["profile"] for s in stopped))
    return {"stopped": stopped, "message": f"stopped {', '.join(profiles)}"}


def clean_unrecorded(state_dir: Path, name: str, progress: Progress) -> None:
    """For `up`: stop the processes of this profile that carry its marker but no record names."""
    for (_profile, component), procs in sorted(
        unrecorded_marked(state_dir, [name]).items(), key=lambda kv: kv[0][1] != "proxy"
    ):
        progress.step(
            f"cleaning up {len(procs)} unrecorded process(es) carrying the {component}'s marker "
            f"(pid {', '.join(str(p.pid) for p in procs)})"
        )
        result = stop_processes(None, procs, 10.0)
        if not result.ok:
            raise MolctlError(f"could not stop leftover {component} processes: {', '.join(result.survivors)}")


def _down_unlisted(
    state_dir: Path, names: list[str] | None, drain_s: float, engine_s: float, progress: Progress
) -> list[dict]:
    """Processes carrying a marker of this state dir that no readable record names (a record never
    written, a state dir that cannot be read): the marker proves they are ours, so they are
    stopped, with a warning."""
    out: dict[str, dict] = {}
    groups = unrecorded_marked(state_dir, names)
    for (profile, component), procs in sorted(groups.items(), key=lambda kv: kv[0][1] != "proxy"):
        progress.warn(
            f"{profile} {component}: no readable record, but {len(procs)} process(es) carry its marker "
            f"(pid {', '.join(str(p.pid) for p in procs)}); stopping them"
        )
        result = stop_processes(None, procs, proxy_stop_timeout(drain_s) if component == "proxy" else engine_s)
        entry = out.setdefault(profile, {"profile": profile, "components": {}})
        entry["components"][component] = "killed" if result.killed else "stopped"
        if not result.ok:
            progress.warn(f"{profile} {component}: process(es) survived SIGKILL: {', '.join(result.survivors)}")
    return list(out.values())


def _down_unreadable(
    state_dir: Path,
    name: str,
    problems: list[RecordProblem],
    drain_s: float,
    engine_s: float,
    force: bool,
    progress: Progress,
) -> dict:
    """A corrupt or unreadable record: report it; find its processes by their marker; stop them
    and remove the record only with --force."""
    found = marked_for(state_dir, name, problems)
    if not force:
        raise unreadable_records_error(state_dir, name, problems)
    out: dict[str, Any] = {"profile": name, "components": {}}
    for problem in sorted(problems, key=lambda p: p.component != "proxy"):
        procs = [p for p, path in found if path == os.path.realpath(problem.path)]
        progress.warn(
            f"{name} {problem.component}: record {problem.path} is unreadable ({problem.error}); "
            f"--force: stopping the {len(procs)} process(es) carrying its marker"
        )
        result = stop_processes(None, procs, proxy_stop_timeout(drain_s) if problem.component == "proxy" else engine_s)
        if not result.ok:
            raise MolctlError(
                f"{name} {problem.component}: process(es) survived SIGKILL: {', '.join(result.survivors)}"
            )
        _remove(state_dir, name, problem.component, progress)
        out["components"][problem.component] = "killed" if result.killed else ("stopped" if procs else "not running")
    return out


def _remove(state_dir: Path, name: str, component: str, progress: Progress) -> None:
    try:
        remove_record(state_dir, name, component)
    except OSError as exc:
        progress.warn(
            f"could not remove the {component} record {record_path(state_dir, name, component)}: "
            f"{exc.strerror or exc} (its processes are gone; remove it by hand)"
        )


def down_one(
    state_dir: Path, name: str, drain_s: float, engine_s: float, force: bool, progress: Progress, gpu_probe=None
) -> dict:
    records = read_records(state_dir, name)
    out: dict[str, Any] = {"profile": name, "components": {}}
    pids = stack_pids(state_dir, name)
    kept = False
    for component in ("proxy", "engine"):  # proxy first: it drains in-flight requests
        record = records.get(component)
        if record is None:
            continue
        timeout = proxy_stop_timeout(drain_s) if component == "proxy" else engine_s
        if not members(record):
            if liveness(record) == "uncertain" and not force:
                progress.warn(
                    f"{name} {component}: pid {record.pid} runs but cannot be verified as the recorded process "
                    f"(a record of an older molctl); not signalled, record kept (--force removes it)"
                )
                out["components"][component] = "unverified"
                kept = True
                continue
            progress.step(f"{name} {component}: not running; removing its record")
            _remove(state_dir, name, component, progress)
            out["components"][component] = "not running"
            continue
        progress.step(f"{name} {component}: stopping (pid {record.pid}, up to {timeout:.0f} s, then SIGKILL)")
        result = stop(
            record,
            timeout,
            on_escalate=lambda c=component: progress.step(f"{name} {c}: still running; sending SIGKILL"),
            on_wait=lambda left, c=component: progress.countdown(f"{name} {c}", left),
            wait_every_s=_every(timeout),
        )
        if not result.ok and not force:
            raise MolctlError(
                f"{name} {component}: process(es) survived SIGKILL: {', '.join(result.survivors)}; "
                f"record kept in {state_dir / name} (--force removes it anyway)"
            )
        out["components"][component] = "killed" if result.killed else "stopped"
        if component == "proxy":
            _remove(state_dir, name, component, progress)
    if kept:
        return out
    leftover = _gpu_leftovers(pids, gpu_probe)
    if leftover and not force:
        raise MolctlError(
            f"{name}: NVML still shows process(es) of the stack on the GPUs: {', '.join(leftover)}; "
            f"engine record kept in {state_dir / name} (--force removes it anyway)"
        )
    engine = records.get("engine")
    if engine is not None and members(engine) and not force:  # never drop a record while a process it names runs
        raise MolctlError(f"{name} engine: still running after the stop; record kept (--force removes it anyway)")
    if engine is not None:
        _remove(state_dir, name, "engine", progress)  # only now: nothing of the stack survives, on the GPUs either
    return out


def _gpu_leftovers(pids: set[int], gpu_probe) -> list[str]:
    from molctl.probes import GpuUnavailable, NvmlProbe

    probe = gpu_probe or NvmlProbe()
    try:
        inventory = probe.inventory()
    except GpuUnavailable:
        return []
    return [f"GPU {d.index} pid {p.pid} {p.name}" for d in inventory.devices for p in d.processes if p.pid in pids]
