"""`state.engine_cache`: the engine's persistent cache dir (molctl.enginecache; `engine.cache_dir`,
default STATE/PROFILE/engine-cache, or the engine's cache root variable in `engine.env`) is a
directory the engine can write, or one `up` can create.
Checked before anything starts: `switch` would otherwise stop the running stack and only then find
that `engine.cache_dir` names a file."""

from __future__ import annotations

import os
from pathlib import Path

from molctl.checks.result import CheckResult, Probes
from molctl.enginecache import cache_dir, set_by

ID = "state.engine_cache"


def run(profile, probes: Probes) -> list[CheckResult]:
    if probes.state_dir is None:
        return [CheckResult(ID, "skip", "no state dir given")]
    path = cache_dir(profile, Path(probes.state_dir))
    field = set_by(profile)
    expected = "expected a directory the engine can write, or a path molctl can create"
    if path.exists():
        if not path.is_dir():
            return [CheckResult(ID, "fail", f"{field} {path} is not a directory ({expected})")]
        if not os.access(path, os.W_OK | os.X_OK):
            return [CheckResult(ID, "fail", f"{field} {path} is not writable ({expected})")]
        return [CheckResult(ID, "pass", f"{path} is a writable directory")]
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is None or not parent.is_dir():
        return [CheckResult(ID, "fail", f"{field} {path}: {parent} is not a directory ({expected})")]
    if not os.access(parent, os.W_OK | os.X_OK):
        return [CheckResult(ID, "fail", f"{field} {path}: {parent} is not writable ({expected})")]
    by = "molctl with mode 0700" if field == "engine.cache_dir" else f"the engine ({field})"
    return [CheckResult(ID, "pass", f"{path} will be created by {by}")]
