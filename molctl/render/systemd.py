"""`molctl render systemd PROFILE`: the engine unit and the proxy unit of one stack
(`render_systemd`), each readied by `python -m molctl.lifecycle.waitready` in its ExecStartPost=, and the
units as one stream (`systemd_stream`)."""

from __future__ import annotations

import math
import re
from pathlib import Path

from molctl.errors import UsageError
from molctl.lifecycle.readiness import proxy_url
from molctl.lifecycle.starter import PROXY_READY_TIMEOUT_S
from molctl.render import (
    STOP_MARGIN_S,
    STORE_PASSWORD_ENV,
    WAIT_MARGIN_S,
    RenderOptions,
    Stack,
    _check_common,
    _store_overrides,
    load_stack,
)
from molctl.state import default_state_dir


def render_systemd(
    name: str, dirs: list[Path], opts: RenderOptions, warnings: list[str] | None = None
) -> dict[str, str]:
    """`{unit file name: text}`: the engine unit and the proxy unit, running the argv `up` would
    run on this host (this interpreter, these profile folders, this state dir). Warnings for the
    operator are appended to `warnings`."""
    import sys

    _check_common(opts)
    if opts.api_key_file is not None:
        key_args = ["--api-key-file", str(opts.api_key_file.expanduser().resolve())]  # as `up` passes it
    elif opts.allow_unauthenticated:
        key_args = ["--allow-unauthenticated"]
    else:
        raise UsageError("systemd: give --api-key-file F (read by the proxy when it starts) or --allow-unauthenticated")
    if opts.user is not None and not re.match(r"^[a-z_][a-z0-9_-]*[$]?$", opts.user):
        raise UsageError(f"--user {opts.user!r}: expected a user name")
    overrides = [*opts.overrides, *_store_overrides(opts)]
    state_dir = Path(opts.state_dir).absolute() if opts.state_dir else None
    # Every folder this invocation searched after the built-in one (`dirs` = profile_dirs(): the
    # MOLCTL_PROFILES_DIR folders that exist, then --profiles-dir), named on the units' argv: `up`'s
    # proxy inherits MOLCTL_PROFILES_DIR, a unit does not inherit the renderer's environment.
    profiles_dirs = [Path(d).resolve() for d in dirs[1:] if Path(d).is_dir()]
    stack = load_stack(
        name,
        dirs,
        overrides,
        opts,
        key_args=key_args,
        python=sys.executable,
        state_dir=state_dir,
        proxy_profiles_dirs=profiles_dirs,
    )
    profile = stack.profile
    if warnings is not None:
        warnings += _user_warnings(
            opts.user, [Path(sys.executable), state_dir, profile.model_root, opts.api_key_file, *profiles_dirs]
        )
    engine_unit, proxy_unit = f"molctl-{name}-engine.service", f"molctl-{name}-proxy.service"
    wait = [sys.executable, "-m", "molctl.lifecycle.waitready"]
    for d in profiles_dirs:
        wait += ["--profiles-dir", str(d)]
    set_json = stack.proxy_argv[stack.proxy_argv.index("--set-json") + 1] if "--set-json" in stack.proxy_argv else None
    engine_wait = [*wait, "engine", name, "--timeout", f"{profile.engine.start_timeout_s:g}"]
    if set_json:
        engine_wait += ["--set-json", set_json]
    engine_wait += [
        "--state-dir",
        str(state_dir or default_state_dir()),
    ]  # the ETA's history (molctl.lifecycle.starthistory)
    proxy_wait = [*wait, "url", f"{proxy_url(profile)}/readyz", "--timeout", f"{PROXY_READY_TIMEOUT_S:g}"]
    user = [f"User={opts.user}"] if opts.user else []
    engine_lines = _engine_unit(name, stack, opts, engine_wait, user)
    proxy_lines = _proxy_unit(name, stack, opts, proxy_wait, user, engine_unit)
    _refuse_line_breaks([*engine_lines, *proxy_lines])
    return {engine_unit: "\n".join(engine_lines) + "\n", proxy_unit: "\n".join(proxy_lines) + "\n"}


def _engine_unit(name: str, stack: Stack, opts: RenderOptions, engine_wait: list[str], user: list[str]) -> list[str]:
    profile = stack.profile
    return [
        "[Unit]",
        f"Description=molctl {name}: {profile.engine.kind} engine ({_no_specifiers(profile.engine.served_name)}, "
        f"{profile.engine.gpus} GPUs)",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=exec",
        *user,
        f"ExecStart={_exec_line(stack.engine_argv)}",
        "# ready as `molctl up` decides it: /health, L0-L3 under the right parent, a 1-token completion per adapter",
        f"ExecStartPost={_exec_line(engine_wait)}",
        *[f"Environment={_env_assignment(k, v)}" for k, v in stack.engine_env.items()],
        "# optional: the engine's secrets (HF_TOKEN=...), never in the profile or the unit",
        f"EnvironmentFile=-/etc/molctl/{name}-engine.env",
        *([f"UnsetEnvironment={' '.join(profile.engine.unset_env)}"] if profile.engine.unset_env else []),
        "KillMode=control-group",
        f"TimeoutStartSec={math.ceil(profile.engine.start_timeout_s) + WAIT_MARGIN_S}",
        f"TimeoutStopSec={_systemd_seconds(opts.stop_timeout_s)}",
        "Restart=on-failure",
        "RestartSec=10",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
    ]


def _proxy_unit(
    name: str, stack: Stack, opts: RenderOptions, proxy_wait: list[str], user: list[str], engine_unit: str
) -> list[str]:
    profile = stack.profile
    return [
        "[Unit]",
        f"Description=molctl {name}: MoL proxy ({_no_specifiers(profile.served_model_name)}, port {profile.proxy.port})",
        f"Requires={engine_unit}",
        f"After={engine_unit}",
        "",
        "[Service]",
        "Type=exec",
        *user,
        f"ExecStart={_exec_line([*stack.proxy_argv, *opts.proxy_args])}",
        f"ExecStartPost={_exec_line(proxy_wait)}",
        f"# optional: {STORE_PASSWORD_ENV}=... (the shared store's password) or MOLCTL_API_KEY=..., never on argv",
        f"EnvironmentFile=-/etc/molctl/{name}-proxy.env",
        "KillMode=control-group",
        "KillSignal=SIGTERM",
        f"TimeoutStartSec={math.ceil(PROXY_READY_TIMEOUT_S) + WAIT_MARGIN_S}",
        f"TimeoutStopSec={_systemd_seconds(opts.drain_timeout_s + STOP_MARGIN_S)}",
        "Restart=on-failure",
        "RestartSec=5",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
    ]


def _refuse_line_breaks(lines: list[str]) -> None:
    for line in lines:  # a line break would end the directive and start another one
        at = min((i for i in (line.find("\n"), line.find("\r")) if i >= 0), default=-1)
        if at >= 0:
            raise UsageError(
                f"systemd: {line.split('=', 1)[0]}= would hold a line break (which would start another "
                f"directive), at ...{line[max(0, at - 60) : at + 60]!r}..."
            )


def _systemd_seconds(seconds: float) -> int:
    """A Timeout*Sec= value: whole seconds, rounded up, at least 1. systemd reads 0 as no timeout
    at all (load-fragment.c config_parse_service_timeout: 0 becomes USEC_INFINITY), the opposite of
    `--stop-timeout 0` (SIGKILL right after SIGTERM)."""
    return max(1, math.ceil(seconds))


def _user_warnings(user: str | None, paths: list[Path | None]) -> list[str]:
    """`--user U` rendered by another user: the paths the units name that lie in the renderer's
    home (the profile's `~`, a virtualenv there), which U may not reach (homes are often 0700)."""
    import getpass

    if user is None or user == getpass.getuser():
        return []
    home = Path.home().resolve()
    inside = [
        str(p)
        for p in paths
        if p is not None and (Path(p).expanduser().resolve() == home or home in Path(p).expanduser().resolve().parents)
    ]
    if not inside:
        return []
    return [
        f"--user {user}: the units name {', '.join(dict.fromkeys(inside))} in {home}, the home of "
        f"{getpass.getuser()}, which {user} may not be able to read: put them where {user} can (--model-root, "
        "--state-dir, an interpreter outside the home) or render as that user"
    ]


def _exec_line(argv: list[str]) -> str:
    """An argv as a systemd command line: each word double-quoted where needed, `$` and `%`
    escaped (systemd would expand them), backslashes and quotes escaped."""
    words = []
    for word in argv:
        escaped = word.replace("\\", "\\\\").replace('"', '\\"').replace("$", "$$").replace("%", "%%")
        words.append(escaped if escaped and re.match(r"^[-\w./:=,+@]+$", escaped) else f'"{escaped}"')
    return " ".join(words)


def _no_specifiers(text: str) -> str:
    """`%` written `%%`: systemd expands specifiers (`%i`, `%n`, ...) in Description= too."""
    return text.replace("%", "%%")


def _env_assignment(key: str, value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return f'"{key}={escaped}"'


def systemd_stream(units: dict[str, str]) -> str:
    return "".join(f"# ---- {unit}\n{text}" for unit, text in units.items())
