"""`molctl status`: the recorded stacks, probed live (read-only: takes no lock, changes nothing).

Each stack is probed where its records say it runs (host, port, pid) and described with the
profile it was started with; its state is one of stopped|starting|ready|degraded|stopping|failed
(see docs/contract.md)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from molctl import stackconfig
from molctl.engines import get_engine
from molctl.engines.base import READYZ_ENGINE_PROBE_MIN_S
from molctl.errors import ProfileError
from molctl.lifecycle.stacks import component_url, known_or_recorded, marked_for, recorded_config, unrecorded_marked
from molctl.processes import members, stack_pids, tail
from molctl.profiles import Profile, load_profile
from molctl.state import (
    COMPONENTS,
    LockHolder,
    Record,
    RecordProblem,
    check_readable,
    deleted_log,
    is_same_process,
    lock_holder,
    profiles_with_records,
    read_records_checked,
)


def status(ctx, name: str | None, gpu_probe=None) -> dict[str, Any]:
    """{"stacks": [...]}: every recorded stack (or the named one; an unknown name is exit 3)."""
    state_dir = ctx.state_dir
    check_readable(state_dir)
    if name:
        known_or_recorded(ctx, name)
    holder = lock_holder(state_dir) if state_dir.exists() else None
    names = [name] if name else profiles_with_records(state_dir)
    if (
        not name
        and holder is not None
        and holder.action in ("up", "switch")
        and holder.profile
        and holder.profile not in names
    ):
        names.append(holder.profile)  # in its preflight: no record written yet
    # also with the state dir deleted under a running stack (`rm -rf`): the markers still name it
    unrecorded = unrecorded_marked(state_dir, names if name else None)
    names += sorted({p for p, _ in unrecorded} - set(names))  # spawned by an `up` killed before recording them
    stacks = []
    for n in names:
        records, problems = read_records_checked(state_dir, n)
        profile = stackconfig.profile_from(recorded_config(records))
        if profile is None:
            try:
                profile = load_profile(n, ctx.dirs())
            except ProfileError:
                profile = None
        stack = _stack_status(state_dir, n, profile, records, problems, holder, gpu_probe)
        unreadable = {p.component for p in problems}  # their processes are named by the unreadable record's line
        orphans = {c: procs for (p, c), procs in unrecorded.items() if p == n and c not in unreadable}
        if orphans and stack["state"] not in ("starting", "stopping"):
            why = "an interrupted `up`?" if (state_dir / n).is_dir() else f"{state_dir / n} was deleted"
            stack["problems"] = stack.get("problems", []) + [
                f"{len(procs)} process(es) carry the {c}'s marker but no record names them (pid "
                f"{', '.join(str(x.pid) for x in procs)}; {why}): `molctl down {n}` stops them"
                for c, procs in sorted(orphans.items())
            ]
            stack["state"] = "degraded"
        stacks.append(stack)
    return {"stacks": stacks}


def _stack_status(
    state_dir: Path,
    name: str,
    profile: Profile | None,
    records: dict[str, Record],
    problems: list[RecordProblem],
    holder: LockHolder | None,
    gpu_probe,
) -> dict:
    """Probe from the records (the host and port actually used, overrides included); the profile
    is the one recorded at the start."""
    components, left = _components(profile, records)
    engine_ok = any(c["name"] == "engine" and c["health"] == 200 for c in components)
    adapters = _adapter_status(profile, records.get("engine")) if engine_ok else None
    state = _state_of(name, records, components, holder)
    if state == "ready" and adapters not in (None, "ok"):
        state = "degraded"
    out: dict[str, Any] = {"profile": name, "state": state, "components": components}
    _add_problems(out, state_dir, name, records, problems, components, left)
    if adapters is not None:
        out["adapters"] = adapters
    _add_details(out, state_dir, name, profile, records, components, gpu_probe)
    return out


def _components(
    profile: Profile | None, records: dict[str, Record]
) -> tuple[list[dict[str, Any]], dict[str, tuple[Record, list]]]:
    """Each recorded component as `status` shows it, and the processes that outlive a dead leader."""
    components = []
    left: dict[str, tuple[Record, list]] = {}  # component -> its record and processes outliving its leader
    now = time.time()
    alive = {c: is_same_process(r) for c, r in records.items()}
    health = _probe_health(profile, {c: r for c, r in records.items() if alive[c]})
    for component in COMPONENTS:
        record = records.get(component)
        if record is None:
            continue
        if not alive[component]:
            # vLLM's API server SIGKILLed (the OOM killer) leaves its EngineCore and workers,
            # which hold the GPU memory: found by the record's marker, as `down` finds them
            procs = members(record)
            if procs:
                left[component] = (record, procs)
        code, detail = health.get(component, (None, None))
        components.append(
            {
                "name": component,
                "pid": record.pid,
                "alive": alive[component],
                "port": record.port,
                "health": code,
                "log": record.log,
                "uptime_s": round(now - record.started_at, 1) if alive[component] else None,
            }
        )
        why = (
            _why_unhealthy(record, code, detail, _probes(profile)[component][1])
            if alive[component] and code != 200
            else None
        )
        if why:
            components[-1]["detail"] = why
    return components, left


def _add_problems(
    out: dict[str, Any],
    state_dir: Path,
    name: str,
    records: dict[str, Record],
    problems: list[RecordProblem],
    components: list[dict[str, Any]],
    left: dict[str, tuple[Record, list]],
) -> None:
    """`problems` (and the state they make degraded or failed): processes outliving their leader,
    a log deleted while it is written, unreadable records."""
    state = out["state"]
    if left and state not in ("starting", "stopping"):
        out["state"] = "degraded"  # something of the stack runs: not `failed`
        out["problems"] = [
            f"the {c} (pid {r.pid}) is gone but {len(procs)} of its process(es) still run (pid "
            f"{', '.join(str(p.pid) for p in procs)}; they may hold GPU memory): `molctl down {name}` "
            f"stops them, `molctl up {name}` restarts the stack"
            for c, (r, procs) in left.items()
        ]
    for component, record in records.items():
        fd = deleted_log(record) if any(c["name"] == component and c["alive"] for c in components) else None
        if fd is not None:  # the disk space an operator meant to free is still held
            out["problems"] = out.get("problems", []) + [
                f"the {component} log {record.log} was deleted while it runs (pid {record.pid} writes on to the "
                f"unlinked file; its disk space is freed only when it stops): `molctl logs {name}` reads it from {fd}"
            ]
    if problems:
        marked = marked_for(state_dir, name, problems)
        for p in problems:
            pids = [str(proc.pid) for proc, path in marked if path == os.path.realpath(p.path)]
            out["problems"] = out.get("problems", []) + [
                f"{p.component} record {p.path} is unreadable ({p.error}); {len(pids)} process(es) carry its marker"
                + (f" (pid {', '.join(pids)}): `molctl down {name} --force` stops them" if pids else "")
            ]
        out["state"] = "degraded" if marked or left or any(c["alive"] for c in components) else "failed"


def _add_details(
    out: dict[str, Any],
    state_dir: Path,
    name: str,
    profile: Profile | None,
    records: dict[str, Record],
    components: list[dict[str, Any]],
    gpu_probe,
) -> None:
    """The recorded canary, the endpoint, the proxy's metrics, the model and the GPUs in use."""
    recorded_canary = (records["engine"].extra or {}).get("canary") if "engine" in records else None
    if isinstance(recorded_canary, dict):  # the adapter efficacy canary of the `up` that started it
        from molctl.lifecycle.canary import brief

        out["canary"] = brief(recorded_canary)
    _add_start(out, state_dir, name, profile, records.get("engine"))
    if "proxy" in records:
        out["endpoint"] = component_url(records["proxy"]) + "/v1"
        proxy_alive = any(c["name"] == "proxy" and c["alive"] for c in components)
        if proxy_alive and profile is not None and profile.proxy.metrics_port:
            out["proxy_metrics"] = proxy_metrics(metrics_url(profile))
    if profile is not None:
        out["model"] = profile.served_model_name
    gpus = _gpu_usage(state_dir, name, gpu_probe) if out["state"] != "stopped" else []
    if gpus:
        out["gpus"] = gpus


def _add_start(out: dict[str, Any], state_dir: Path, name: str, profile: Profile | None, engine: Record | None) -> None:
    """The engine cache and the last start's phases (recorded by `up`); while the stack starts,
    its phase (from the engine's log) and the time left (molctl.lifecycle.starthistory)."""
    extra = (engine.extra or {}) if engine is not None else {}
    if isinstance(extra.get("cache"), dict):
        out["cache"] = extra["cache"]
    if isinstance(extra.get("start"), dict):
        out["last_start"] = extra["start"]
    if out["state"] != "starting" or profile is None:
        return
    from molctl.lifecycle import starthistory
    from molctl.phases import log_phase

    found = log_phase(get_engine(profile.engine.kind).phases, tail(engine.log, 50)) if engine is not None else None
    phase, detail = found or ("config", "")
    if engine is not None and "canary" in extra:
        phase, detail = "proxy", ""
    est = starthistory.estimate(state_dir, name)
    elapsed = time.time() - engine.started_at if engine is not None else 0.0
    left = est.remaining(elapsed, phase)
    out["phase"] = phase
    out["phase_detail"] = detail
    out["eta_s"] = None if left is None else round(left, 1)
    out["eta"] = est.summary()


def _probes(profile: Profile | None) -> dict[str, tuple[str, float]]:
    """component -> (path, timeout) of its health probe."""
    engine_s = get_engine(profile.engine.kind).health_timeout_s if profile else 1.0
    return {"engine": ("/health", engine_s), "proxy": ("/readyz", max(READYZ_ENGINE_PROBE_MIN_S, engine_s) + 1.0)}


def _probe_health(profile: Profile | None, live: dict[str, Record]) -> dict[str, tuple[int | None, str | None]]:
    """component -> (the HTTP status, the detail) of the engine's /health or the proxy's /readyz, probed at
    the same time (a hung engine costs one timeout, not one per component). The engine's may take
    its time (SGLang's generates a token); the proxy's /readyz asks the engine itself, with at
    least READYZ_ENGINE_PROBE_MIN_S, so it gets one second more than that: a healthy proxy reporting a
    hung engine answers 503, not "no answer"."""
    from concurrent.futures import ThreadPoolExecutor

    probes = _probes(profile)
    if not live:
        return {}
    with ThreadPoolExecutor(max_workers=len(live)) as pool:
        futures = {c: pool.submit(_probe, component_url(r) + probes[c][0], probes[c][1]) for c, r in live.items()}
        out = {c: f.result() for c, f in futures.items()}
    if out.get("proxy", (None,))[0] == 200 and out.get("engine", (200,))[0] != 200:
        # the proxy reuses a ready answer for up to 1 s (ready_cache_s): by now it asks the engine again
        out["proxy"] = _probe(component_url(live["proxy"]) + probes["proxy"][0], probes["proxy"][1])
    return out


def _probe(url: str, timeout: float) -> tuple[int | None, str | None]:
    """The HTTP status and, when not 200, the `detail` the proxy's /readyz gives (draining,
    engine unreachable, adapters missing)."""
    import httpx

    from molctl import localhttp

    try:
        r = localhttp.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None, None
    try:
        detail = r.json().get("detail") if r.status_code != 200 else None
    except (ValueError, AttributeError):
        detail = None
    return r.status_code, detail if isinstance(detail, str) else None


def _why_unhealthy(record: Record, health: int | None, detail: str | None, timeout_s: float) -> str | None:
    """Why a live component is not healthy, in words (status said only `-` or `503`)."""
    try:
        with open(f"/proc/{record.pid}/stat") as fh:
            stopped = fh.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        stopped = False
    if stopped:
        return f"stopped by a signal (SIGSTOP or Ctrl-Z): `kill -CONT {record.pid}` resumes it"
    if health is None:
        return f"no answer on {component_url(record)} within {timeout_s:g} s"
    return detail


STATUS_METRICS = {  # shown by `molctl status`: key -> (sample name, labels that must match)
    "requests": ("molctl_proxy_requests_total", {}),
    "rejected_429": ("molctl_proxy_admission_rejections_total", {}),
    "engine_errors": ("molctl_proxy_engine_errors_total", {}),
    "route_fallbacks": ("molctl_proxy_route_fallbacks_total", {}),
    "answers_in_flight": ("molctl_proxy_inflight_hops", {"hop": "answer"}),
    "queued": ("molctl_proxy_queue_depth", {"hop": "answer"}),
}


def metrics_url(profile: Profile) -> str:
    from molctl.lifecycle.readiness import base_url

    return base_url(profile.proxy.metrics_host, profile.proxy.metrics_port) + "/metrics"


def proxy_metrics(url: str, timeout: float = 1.0) -> dict[str, Any]:
    """A few of the proxy's metrics from its metrics listener; {"available": false} when it
    does not answer (not an error: status reports, it does not judge)."""
    import re

    import httpx

    from molctl import localhttp

    try:
        r = localhttp.get(url, timeout=timeout)
    except httpx.HTTPError:
        return {"available": False, "url": url}
    if r.status_code != 200:
        return {"available": False, "url": url}
    out: dict[str, Any] = {"available": True, "url": url, **dict.fromkeys(STATUS_METRICS, 0.0)}
    for line in r.text.splitlines():
        m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        for key, (name, want) in STATUS_METRICS.items():
            if m.group(1) == name and all(labels.get(k) == v for k, v in want.items()):
                try:
                    out[key] += float(m.group(3))
                except ValueError:
                    pass
    for key in STATUS_METRICS:  # counts, as integers in --json (Prometheus writes them as floats)
        if out[key] == out[key] and abs(out[key]) != float("inf") and out[key] == int(out[key]):
            out[key] = int(out[key])
    return out


def _adapter_status(profile: Profile | None, record: Record | None) -> str | None:
    """'ok' when the live engine lists L0-L3 under the expected parent, else what is wrong."""
    from molctl.engines.base import adapter_problems

    if profile is None or record is None:
        return None
    try:
        import httpx

        from molctl import localhttp

        models = localhttp.get(component_url(record) + "/v1/models", timeout=2.0).json()
    except (httpx.HTTPError, ValueError):
        return "/v1/models not answering"
    problems = adapter_problems(profile, get_engine(profile.engine.kind), models)
    return "; ".join(problems) if problems else "ok"


def _state_of(name: str, records: dict, components: list[dict], holder: LockHolder | None) -> str:
    """stopped|starting|ready|degraded|stopping|failed (see docs/contract.md). The state lock's
    holder says what is changing: `up`/`switch` of this profile -> starting (from the preflight on,
    before any record exists); `down` of it (or of every stack), or a `switch` to another profile
    (which stops whatever runs) -> stopping."""
    mine = holder is not None and holder.profile == name
    if holder is not None and holder.action in ("up", "switch") and mine:
        return "starting"
    if not records:
        return "stopped"
    if holder is not None and (
        (holder.action == "down" and (holder.profile is None or mine)) or (holder.action == "switch" and not mine)
    ):
        return "stopping"
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
