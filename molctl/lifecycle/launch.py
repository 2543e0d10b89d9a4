"""The engine's and the proxy's command lines and environment (`engine_argv`, `engine_env`,
`proxy_argv`, `engine_upstream`): what `molctl up` spawns and `molctl render` writes into
manifests and units, from one code path."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molctl.engines import get_engine
from molctl.lifecycle.readiness import base_url
from molctl.lifecycle.stop import ENGINE_STOP_TIMEOUT_S
from molctl.profiles import Profile

PROXY_SECRET_ENV = ("MOLCTL_API_KEY", "MOLCTL_STORE_PASSWORD")  # the proxy's secrets: never the engine's


@dataclass
class UpOptions:
    """What `up` (and `switch`, `render`) was asked: the overrides, the checks skipped, the proxy's
    key and drain, where profiles are looked up, and how a running stack is replaced."""

    overrides: list[tuple[str, Any]] = field(default_factory=list)
    skip: Iterable[str] = ()
    timeout_s: float | None = None
    api_key_file: Path | None = None
    allow_unauthenticated: bool = False
    drain_timeout_s: float = 600.0
    profiles_dirs: list[Path] = field(default_factory=list)
    restart: bool = False  # stop this profile's running stack first (another configuration, or a plain restart)
    stop_timeout_s: float = ENGINE_STOP_TIMEOUT_S  # for what `up --restart` / `switch` stop
    verify: Any = None  # `up --verify`: a molctl.checks.verify.Verify; the preflight adds the `lock` category
    prefetch: bool = True  # `switch`: read the target's shards into the page cache while the old stack drains


def engine_env(profile: Profile, base: dict[str, str] | None = None, cache_dir: Path | None = None) -> dict[str, str]:
    """The engine's environment: `base` (default: this process's) without `engine.unset_env`,
    plus the variables that point it at `cache_dir` (molctl.enginecache), plus `engine.env`
    (which wins), never the proxy's secrets. `molctl render` passes an empty base."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in profile.engine.unset_env}
    if cache_dir is not None:
        env.update(get_engine(profile.engine.kind).cache_env(cache_dir))
    env.update(profile.engine.env)
    for name in PROXY_SECRET_ENV:
        env.pop(name, None)
    return env


def engine_argv(profile: Profile) -> list[str]:
    """The engine's command line (`up` spawns it; `molctl render` writes it into manifests and units)."""
    return get_engine(profile.engine.kind).launch_argv(profile)


def engine_upstream(profile: Profile) -> str:
    """The engine URL the proxy is given (`--upstream`): the engine's listen address, a wildcard
    one reached through loopback (what `up` passes, from the engine's record)."""
    return base_url(profile.engine.host, profile.engine.port)


def proxy_argv(
    profile: Profile,
    opts: UpOptions,
    key_args: list[str],
    upstream: str,
    *,
    python: str = sys.executable,
    state_dir: Path | None = None,
) -> list[str]:
    """The proxy's command line (`up` spawns it; `molctl render` writes it into manifests and
    units). The start's overrides travel as typed JSON (`--set-json`), never re-parsed as text:
    `--set 'served_model_name="2024"'` reaches the proxy as the string 2024. `state_dir` holds
    its response store (STATE/PROFILE)."""
    argv = [python, "-m", "molctl"]
    if state_dir is not None:
        argv += ["--state-dir", str(state_dir)]
    for d in opts.profiles_dirs:
        argv += ["--profiles-dir", str(Path(d).resolve())]
    argv += [
        "proxy",
        profile.name,
        "--upstream",
        upstream,
        "--host",
        profile.proxy.host,
        "--port",
        str(profile.proxy.port),
        "--drain-timeout",
        str(opts.drain_timeout_s),
    ]
    if profile.proxy.metrics_port:
        argv += ["--metrics-port", str(profile.proxy.metrics_port)]
    # the engine's environment is no business of the proxy, and an argv is world-readable (ps,
    # /proc/PID/cmdline): `--set engine.env.HF_TOKEN=...` put the token there
    overrides = [[k, v] for k, v in opts.overrides if k != "engine.env" and not k.startswith("engine.env.")]
    if overrides:
        argv += ["--set-json", json.dumps(overrides)]
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
