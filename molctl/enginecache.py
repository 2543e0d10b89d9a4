"""Each profile's persistent engine cache directory: what the engine compiles or tunes once
(torch.compile graphs, Triton and Inductor kernels, CUDA-graph and autotuning results) kept across
restarts instead of rebuilt on each start (166 s per restart in one report, issue 44).

The directory is `engine.cache_dir` of the profile (a relative path: below STATE/PROFILE), by
default STATE/PROFILE/engine-cache. The engine module names the variables that point the
engine at it (`Engine.cache_env`): vLLM's `VLLM_CACHE_ROOT` (vllm/envs.py; its torch.compile
cache lives in `$VLLM_CACHE_ROOT/torch_compile_cache`, vllm/compilation/backends.py), SGLang's
`TORCHINDUCTOR_CACHE_DIR` (https://docs.sglang.io/references/torch_compile_cache.html) and
`TRITON_CACHE_DIR`. A variable the profile sets itself in `engine.env` wins. When it is the
engine's cache root (`Engine.cache_root_env`: vLLM's `VLLM_CACHE_ROOT`; SGLang has none), its
value is the directory everywhere: what `up` reports, what `check` probes (state.engine_cache)
and what `molctl render` mounts (systemd: the variables; Kubernetes: a volume)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from molctl.errors import ExitStatus, MolctlError

DEFAULT_NAME = "engine-cache"


def _env_root(profile) -> str | None:
    """The engine's cache root variable (`Engine.cache_root_env`) when the profile's engine.env sets it."""
    from molctl.engines import get_engine

    root = get_engine(profile.engine.kind).cache_root_env
    return root if root and (profile.engine.env or {}).get(root) else None


def set_by(profile) -> str:
    """The profile field that names the directory: `engine.env.<the engine's cache root variable>`
    when the profile sets it, else `engine.cache_dir`."""
    root = _env_root(profile)
    return f"engine.env.{root}" if root else "engine.cache_dir"


def cache_dir(profile, state_dir: Path) -> Path:
    """Where `profile`'s engine keeps its caches on this host."""
    root = _env_root(profile)
    if root:
        return Path(os.path.expanduser(profile.engine.env[root]))
    configured = getattr(profile.engine, "cache_dir", "") or ""
    base = Path(state_dir) / profile.name
    if not configured:
        return base / DEFAULT_NAME
    path = Path(os.path.expanduser(configured))
    return path if path.is_absolute() else base / path


def _has_entries(path: Path) -> bool:
    try:
        with os.scandir(path) as it:
            return any(True for _ in it)
    except OSError:
        return False


def prepare(profile, state_dir: Path) -> dict[str, Any]:
    """Create the directory (0700) before the engine starts; `warm`: it held something already
    (an earlier start filled it). Returns `{"dir", "warm"}`, what `up` records for `status`; plus
    `"set_by"` when the profile's `engine.env` names it (the engine creates that one itself).
    """
    field, path = set_by(profile), cache_dir(profile, state_dir)
    warm = _has_entries(path)
    if field != "engine.cache_dir":
        return {"dir": str(path), "warm": warm, "set_by": field}
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, a read-only mount: `check` says so as state.engine_cache
        raise MolctlError(
            f"{field} {path}: {exc.strerror or exc} (expected a directory the engine can write, "
            "or a path molctl can create)",
            ExitStatus.CHECK_FAILED,
        ) from None
    return {"dir": str(path), "warm": warm}
