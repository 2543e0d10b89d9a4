"""The configuration a stack was started with, stored in its records.

`up` records the profile data exactly as validated (the file with the start's `--set` and
`--model-root` overrides applied), its digest, the overrides and the command that starts it
again. A running stack is then described by its records: `up` compares digests (a different
configuration refuses instead of "waiting" on the wrong port), `status` rebuilds the profile
from the record (not from a file that may have been edited since), and a failed `switch` prints
the command that brings the old stack back.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from molctl.errors import ProfileError
from molctl.profiles import Profile, build_profile, check_profile_name, profile_files
from molctl.profileyaml import load_yaml_with_lines


def unknown_profile(name: str, dirs: list[Path]) -> ProfileError:
    files = profile_files(dirs)
    known = ", ".join(sorted(files)) or "none"
    return ProfileError(f"no profile named {name!r} (known: {known}; searched: {', '.join(str(d) for d in dirs)})")


def load(name: str, dirs: Iterable[Path], overrides: Iterable[tuple[str, Any]] = ()) -> tuple[Profile, dict]:
    """The profile and the configuration to record for it."""
    check_profile_name(name)
    dirs = list(dirs)
    files = profile_files(dirs)
    if name not in files:
        raise unknown_profile(name, dirs)
    path = files[name]
    overrides = [(k, v) for k, v in overrides]
    data, lines = load_yaml_with_lines(path)
    profile = build_profile(data, path, lines, overrides, expected_name=path.stem)  # applies the overrides to data
    return profile, {
        "profile": name,
        "source": str(path),
        "data": data,
        "digest": digest(data),
        "overrides": [[k, v] for k, v in overrides],
    }


def digest(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def profile_from(config: dict) -> Profile | None:
    """The profile a stack was started with, from its recorded configuration."""
    if not config.get("data") or not config.get("source"):
        return None
    try:
        return build_profile(copy.deepcopy(config["data"]), Path(config["source"]))
    except (ProfileError, KeyError, TypeError, ValueError):
        return None


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: data}


def differences(old: dict, new: dict, limit: int = 3) -> str:
    """'engine.port 8100 -> 9000, ...' between two recorded configurations."""
    if not old.get("data"):
        return "recorded by an older molctl"
    a, b = _flatten(old["data"]), _flatten(new["data"])
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if not keys:
        return "same settings, different profile file" if old.get("source") != new.get("source") else "no difference"

    def short(v: Any) -> str:
        text = "unset" if v is None else (json.dumps(v) if not isinstance(v, str) else v)
        return text if len(text) <= 40 else text[:37] + "..."

    shown = [f"{k} {short(a.get(k))} -> {short(b.get(k))}" for k in keys[:limit]]
    return ", ".join(shown) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def up_command(
    name: str,
    overrides: Iterable[tuple[str, Any]],
    key_args: list[str],
    state_dir: Path | None = None,
    profiles_dirs: Iterable[Path] = (),
    options: Iterable[str] = (),
) -> str:
    """The `molctl up` command line that starts this configuration again (values as JSON, which
    `--set` reads back as the same typed value), with the start's `options` (`--skip`,
    `--timeout`: a stack that needed them to start needs them again)."""
    argv = ["molctl"]
    if state_dir is not None:
        argv += ["--state-dir", str(state_dir)]
    for d in profiles_dirs:
        argv += ["--profiles-dir", str(d)]
    argv += ["up", name]
    for key, value in overrides:
        argv += ["--set", f"{key}={json.dumps(value)}"]
    argv += list(options) + key_args
    return shlex.join(argv)
