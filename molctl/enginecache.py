"""Each profile's persistent engine cache directory: what the engine compiles or tunes once
(torch.compile graphs, Triton and Inductor kernels, CUDA-graph and autotuning results) kept across
restarts instead of rebuilt on each start (166 s per restart in one report, issue 44).

The directory is `engine.cache_dir` of the profile (a relative path: below STATE/PROFILE), by
default STATE/PROFILE/engine-cache. The engine module names the variables that point the
engine at it (`Engine.cache_env`): vLLM's `VLLM_CACHE_ROOT` (vllm/envs.py; its torch.compile
cache lives in `$VLLM_CACHE_ROOT/torch_compile_cache`, vllm/compilation/backends.py), SGLang's
`TORCHINDUCTOR_CACHE_DIR` (https://docs.sglang.io/references/torch_compile_cache.html) and
`TRITON_CACHE_DIR`. A variable the profile sets itself in `engine.env` wins. `molctl render`
mounts the same directory (systemd: the variables; Kubernetes: a volume)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from molctl.errors import ExitStatus, MolctlError

DEFAULT_NAME = "engine-cache"


def cache_dir(profile, state_dir: Path) -> Path:
    """Where `profile`'s engine keeps its caches on this host."""
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


def prepare(profile, state_dir: Path, env_names: tuple[str, ...] = ()) -> dict[str, Any]:
    """Create the directory (0700) before the engine starts; `warm`: it held something already
    (an earlier start filled it). Returns `{"dir", "warm"}`, what `up` records for `status`.
    `env_names`: the engine's cache variables (`Engine.cache_env`); when the profile's `engine.env`
    sets the first, the engine uses that directory, so it is the one reported (`"set_by"`) and
    molctl's own is not created."""
    own = env_names[0] if env_names else None
    if own and (profile.engine.env or {}).get(own):
        path = Path(os.path.expanduser(profile.engine.env[own]))
        return {"dir": str(path), "warm": _has_entries(path), "set_by": f"engine.env.{own}"}
    path = cache_dir(profile, state_dir)
    warm = _has_entries(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, a read-only mount: `check` says so as state.engine_cache
        raise MolctlError(
            f"engine.cache_dir {path}: {exc.strerror or exc} (expected a directory the engine can write, "
            "or a path molctl can create)",
            ExitStatus.CHECK_FAILED,
        ) from None
    return {"dir": str(path), "warm": warm}
