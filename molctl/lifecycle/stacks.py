"""What runs, as the records and markers of a state dir describe it (read-only; shared by up,
down, switch, status and logs).

A running stack is described by its records, never by the profile file as it reads now: the
host and port each component was started on, and the configuration it was started with
(`molctl.stackconfig`)."""

from __future__ import annotations

import os
from pathlib import Path

from molctl import stackconfig
from molctl.errors import ExitStatus, MolctlError
from molctl.lifecycle.readiness import base_url, http_status
from molctl.processes import is_alive, marked_by_path, stack_pids
from molctl.profiles import check_profile_name, profile_files
from molctl.state import (
    COMPONENTS,
    Record,
    RecordProblem,
    is_same_process,
    profiles_with_records,
    read_records,
    read_records_checked,
)


def component_url(record: Record) -> str:
    """The base URL of a recorded component: its recorded host and port."""
    return base_url(record.host, record.port)


def running_profiles(state_dir: Path) -> list[str]:
    """Profiles with a live process, or a record that cannot be read (it may hide one)."""
    return [
        p for p in profiles_with_records(state_dir) if stack_pids(state_dir, p) or read_records_checked(state_dir, p)[1]
    ]


def stack_ready(records: dict[str, Record]) -> bool:
    """Both recorded components alive and healthy, probed on their recorded host and port."""
    if set(records) != set(COMPONENTS) or not all(is_same_process(r) for r in records.values()):
        return False
    return (
        http_status(component_url(records["engine"]) + "/health") == 200
        and http_status(component_url(records["proxy"]) + "/readyz") == 200
    )


def recorded_config(records: dict[str, Record]) -> dict:
    """The configuration the stack was started with (see `molctl.stackconfig`), or {}."""
    for component in COMPONENTS:
        if component in records and records[component].config:
            return records[component].config
    return {}


def unrecorded_marked(state_dir: Path, names: list[str] | None = None) -> dict[tuple[str, str], list]:
    """(profile, component) -> live processes carrying a marker of this state dir that no readable
    record names: its record was never written (molctl killed between a spawn and its record), or
    the state dir cannot be read. The marker proves they are ours."""
    import psutil

    from molctl import procid

    root = os.path.realpath(state_dir).rstrip("/") + "/"
    ids: dict[str, dict[str, str]] = {}
    groups: dict[tuple[str, str], list] = {}
    for pid, path, rid in procid.marked_processes():
        rel = path[len(root) :].split("/") if path.startswith(root) else []
        if len(rel) != 2 or not rel[1].endswith(".json") or (names is not None and rel[0] not in names):
            continue
        profile, component = rel[0], rel[1].removesuffix(".json")
        if profile not in ids:
            ids[profile] = {c: r.record_id for c, r in read_records(state_dir, profile).items()}
        if rid and ids[profile].get(component) == rid:
            continue  # its record's: stopped (or kept) with that record
        try:
            proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        if is_alive(proc):
            groups.setdefault((profile, component), []).append(proc)
    return groups


def marked_for(state_dir: Path, name: str, problems: list[RecordProblem]):
    """(process, record path) of the processes carrying the marker of an unreadable record."""
    paths = {os.path.realpath(p.path) for p in problems}
    return [(p, path) for p, path in marked_by_path(state_dir / name) if path in paths]


def unreadable_records_error(state_dir: Path, name: str, problems: list[RecordProblem]) -> MolctlError:
    found = marked_for(state_dir, name, problems)
    procs = ", ".join(f"pid {p.pid} ({_pname(p)})" for p, _ in found) or "none found"
    first = problems[0]
    return MolctlError(
        f"{name}: the {first.component} record {first.path} is unreadable ({first.error}); "
        f"processes carrying its marker: {procs}; `molctl down {name} --force` stops them and "
        f"removes the record",
        ExitStatus.CONFLICT,
    )


def _pname(proc) -> str:
    try:
        return proc.name()
    except Exception:  # noqa: BLE001 - gone meanwhile
        return "?"


def known_or_recorded(ctx, name: str) -> None:
    """An unknown profile name (a typo) is exit 3 listing the known ones, unless records of it exist
    or processes carry a marker of it (its folder, or the whole state dir, deleted under them).
    A name that is no profile name (`..`, `tiny/../tiny`) is exit 3 before any path is joined."""
    check_profile_name(name)
    try:
        if (ctx.state_dir / name).is_dir():
            return
    except OSError:
        return
    dirs = ctx.dirs()
    if name not in profile_files(dirs) and not marked_by_path(ctx.state_dir / name):
        raise stackconfig.unknown_profile(name, dirs)
