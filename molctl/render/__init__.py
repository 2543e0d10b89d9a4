"""`molctl render k8s|systemd PROFILE`: Kubernetes manifests or systemd units for one stack, from
the same profile, overrides and argv code as `molctl up` (molctl.lifecycle.launch.engine_argv and
proxy_argv: one code path). Rendering reads the profile file and nothing else: it never touches
the state dir, reads no key file and starts nothing.

Kubernetes: a ConfigMap (the profile file, mounted where the proxy's `--profiles-dir` points), a
Service for the proxy port only, and a StatefulSet of pods each running a whole stack (engine +
proxy containers). A StatefulSet rather than a Deployment: its pods have stable names (the
replica id a shared store keys conversation ownership by survives a restart: pass it with
`--proxy-arg=--replica-id=$(POD_NAME)`), and a rolling update replaces one pod at a time in
place, never surging an extra pod that would need another `engine.gpus` GPUs and an hour of
model load; `podManagementPolicy: Parallel` loads every replica's model at once.

Termination, in one pod: the proxy's preStop waits PRESTOP_DELAY_S (the endpoints drop the pod),
then SIGTERM starts its drain (/readyz 503, in-flight requests finish up to --drain-timeout); the
engine's preStop waits until the proxy has exited, then the engine gets SIGTERM and up to
--stop-timeout. terminationGracePeriodSeconds covers all three plus STOP_MARGIN_S.

`molctl.render.k8s` (`render_k8s`) and `molctl.render.systemd` (`render_systemd`) render; this
module holds what both share: `RenderOptions`, `load_stack` (the argv and environment `up` would
run), the timing constants and `write_files`.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molctl import stackconfig
from molctl.errors import MolctlError, ProfileError, UsageError
from molctl.lifecycle.launch import UpOptions, engine_argv, engine_env, engine_upstream, proxy_argv
from molctl.lifecycle.stop import ENGINE_STOP_TIMEOUT_S
from molctl.profiles import Profile
from molctl.redaction import (
    URL_CREDENTIALS_RE,
    is_secret_name,
    secret_engine_args,
)  # what `lock` redacts, render refuses

PROFILES_MOUNT = "/etc/molctl/profiles"  # the ConfigMap with the profile file (the proxy's --profiles-dir)
KEYS_MOUNT = "/etc/molctl/api-keys"  # the API-key Secret, mounted read-only
KEYS_SECRET_KEY = "api-keys"  # the Secret's key holding the key file (one key per line)
STATE_MOUNT = "/var/lib/molctl"  # the proxy's --state-dir (an emptyDir: a sqlite store lives and dies with the pod)
STORE_PASSWORD_ENV = "MOLCTL_STORE_PASSWORD"  # the shared store's password, from a Secret (never on argv)
STARTUP_PERIOD_S = 10  # the engine's startupProbe period; failureThreshold covers engine.start_timeout_s
PRESTOP_DELAY_S = 5  # the proxy's preStop: the Service's endpoints drop the pod before the drain starts
WAIT_MARGIN_S = 10  # TimeoutStartSec over the ExecStartPost wait's --timeout: the wait says why before systemd kills it
STOP_MARGIN_S = 15  # on top of delay + drain + engine stop in terminationGracePeriodSeconds / TimeoutStopSec
DEFAULT_PYTHON = "python3"  # the image's interpreter (molctl's; the engine's unless engine.python is set)
MAX_REPLICAS = 2**31 - 1  # StatefulSet spec.replicas is an int32
DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
# The objects' NAME: a Service name is a DNS-1035 label (a letter first), and a StatefulSet's pods
# carry the label controller-revision-hash=NAME-<10 characters>, a label value of at most 63: a
# longer NAME is accepted by the API server but never gets a pod (kubernetes/kubernetes#64023).
MAX_NAME = 52
OBJECT_NAME = re.compile(r"^[a-z]([a-z0-9-]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$")

# Exec probes in the engine container: the engine listens on engine.host (loopback by default),
# which the kubelet's httpGet (to the pod IP) cannot reach; the engine's own Python can.
PROBE_SCRIPT = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2]))"
# The engine's preStop: the kubelet runs it when the pod stops, and also when it restarts the
# engine container alone after a failed liveness or startup probe (Kubernetes, "Container
# Lifecycle Hooks"). Only in the first case does the proxy drain: wait while its /health says
# "draining" (up to argv[3] s) and until it stops answering; a proxy still "ok" argv[1] s after the
# start (its own preStop delay plus a margin) is not stopping, so the engine is stopped at once.
DRAIN_SEEN_WITHIN_S = PRESTOP_DELAY_S + 5
WAIT_GONE_SCRIPT = """import json, sys, time, urllib.request
start = time.monotonic()
while time.monotonic() - start < float(sys.argv[3]):
    try:
        with urllib.request.urlopen(sys.argv[2], timeout=2) as answer:
            draining = json.load(answer).get("status") == "draining"
    except Exception:
        break
    if not draining and time.monotonic() - start >= float(sys.argv[1]):
        break
    time.sleep(1)
"""


class RenderError(MolctlError):
    """`--output` could not be created or written (exit 1)."""


@dataclass
class RenderOptions:
    overrides: list[tuple[str, Any]] = field(default_factory=list)  # --model-root, --set (as `up`)
    drain_timeout_s: float = 600.0
    stop_timeout_s: float = ENGINE_STOP_TIMEOUT_S
    store: str | None = None  # proxy.store (e.g. redis://redis:6379/0), rendered as `--set proxy.store=...`
    allow_unauthenticated: bool = False
    proxy_args: list[str] = field(default_factory=list)  # appended to the proxy argv, e.g. --replica-id=$(POD_NAME)
    # Kubernetes
    image: str | None = None
    engine_image: str | None = None
    python: str = DEFAULT_PYTHON
    replicas: int = 1
    namespace: str | None = None
    name: str | None = None  # the objects' name; default molctl-PROFILE
    api_key_secret: str | None = None  # default NAME-api-keys
    store_password_secret: str | None = None  # SECRET[:KEY] -> env MOLCTL_STORE_PASSWORD
    engine_env_secret: str | None = None  # every key of this Secret becomes an engine variable (HF_TOKEN, ...)
    model_pvc: str | None = None  # the model from this PersistentVolumeClaim instead of a hostPath
    shm_size: str | None = None
    scheduler: str = "stack"  # stack (each pod a whole stack) or llm-d (molctl.render.llmd)
    proxy_replicas: int = 2  # --scheduler llm-d: the proxy Deployment's replicas
    cache_pvc: str | None = None  # --scheduler llm-d: the engines' cache volume (default: an emptyDir)
    # systemd
    api_key_file: Path | None = None
    state_dir: Path | None = None
    user: str | None = None


@dataclass
class Stack:
    """What `up` would run for this profile and these overrides."""

    profile: Profile
    config: dict
    engine_argv: list[str]
    engine_env: dict[str, str]  # the profile's part of it (`engine.env`); unset_env is the renderer's job
    proxy_argv: list[str]  # without --proxy-arg
    cache_dir: Path | None = None  # the engine's persistent cache (molctl.enginecache), in engine_env already


def load_stack(
    name: str,
    dirs: list[Path],
    overrides: list[tuple[str, Any]],
    opts: RenderOptions,
    *,
    key_args: list[str],
    python: str,
    state_dir: Path,
    proxy_profiles_dirs: list[Path],
    default_engine_python: str | None = None,
    upstream: str | None = None,
) -> Stack:
    """The profile with `overrides` (and `engine.python` = `default_engine_python` when the
    profile names none), and the engine and proxy argv `up` builds from it; `upstream`: the
    proxy's --upstream (default: the profile's engine, as `up`)."""
    profile, config = stackconfig.load(name, dirs, overrides)
    if default_engine_python and not config["data"]["engine"].get("python"):
        overrides = [*overrides, ("engine.python", default_engine_python)]
        profile, config = stackconfig.load(name, dirs, overrides)
    secret = next((k for k in profile.engine.env if is_secret_name(k)), None)
    if secret is not None:
        raise ProfileError(
            f"{config['source']}: field 'engine.env.{secret}': its name says it is a secret (KEY, TOKEN, "
            "SECRET, PASSWORD, PASSWD or CREDENTIAL), and render never writes secrets into manifests or "
            "units: remove it from the profile and give it to the engine from a Secret (render k8s "
            "--engine-env-secret) or the engine unit's EnvironmentFile"
        )
    in_url = next((k for k, v in profile.engine.env.items() if URL_CREDENTIALS_RE.search(str(v))), None)
    if in_url is not None:
        raise ProfileError(
            f"{config['source']}: field 'engine.env.{in_url}': its value is a URL with a user name or "
            "password (scheme://user:pass@host), and render never writes secrets into manifests or units: "
            "give the variable to the engine from a Secret (render k8s --engine-env-secret) or the engine "
            "unit's EnvironmentFile"
        )
    _refuse_secret_args(profile, config["source"])
    up_opts = UpOptions(overrides=overrides, drain_timeout_s=opts.drain_timeout_s, profiles_dirs=proxy_profiles_dirs)
    proxy = proxy_argv(
        profile, up_opts, key_args, upstream or engine_upstream(profile), python=python, state_dir=state_dir
    )
    from molctl.enginecache import cache_dir
    from molctl.state import default_state_dir

    cache = cache_dir(profile, state_dir or default_state_dir())
    return Stack(profile, config, engine_argv(profile), engine_env(profile, base={}, cache_dir=cache), proxy, cache)


def _refuse_secret_args(profile: Profile, source: str) -> None:
    """An engine flag that is a secret (`api-key`, `hf-token`: a word of its name is KEY, TOKEN,
    SECRET, PASSWORD, PASSWD or CREDENTIAL; `max-num-batched-tokens` and `ssl-keyfile` are not), or
    whose value is a URL with a user name or password: it would be written in clear into the
    args, the proxy's --set-json, the ConfigMap or ExecStart=."""
    for flag, why in secret_engine_args(profile.engine.args)[:1]:
        raise ProfileError(
            f"{source}: field 'engine.args.{flag}': {why}, and render never writes secrets into "
            "manifests or units: give it to the engine through its environment (e.g. VLLM_API_KEY, "
            "HF_TOKEN) from a Secret (render k8s --engine-env-secret) or the engine unit's EnvironmentFile"
        )


def _check_common(opts: RenderOptions) -> None:
    for label, value in (("--drain-timeout", opts.drain_timeout_s), ("--stop-timeout", opts.stop_timeout_s)):
        if not (value >= 0 and math.isfinite(value)):
            raise UsageError(f"{label} {value:g}: expected a number of seconds >= 0")


def _store_overrides(opts: RenderOptions) -> list[tuple[str, Any]]:
    return [("proxy.store", opts.store)] if opts.store is not None else []


def grace_period_s(opts: RenderOptions) -> int:
    """Seconds a stopping pod (or proxy unit) may take: endpoint delay, drain, engine stop, margin."""
    return math.ceil(PRESTOP_DELAY_S + opts.drain_timeout_s + opts.stop_timeout_s + STOP_MARGIN_S)


def default_shm_size(profile: Profile) -> str:
    """/dev/shm for the engine: 2 GiB per GPU (tensor-parallel workers exchange through it; vLLM's
    Kubernetes guide mounts 2 GiB for one GPU), 1 GiB without GPUs."""
    return f"{2 * profile.engine.gpus}Gi" if profile.engine.gpus > 0 else "1Gi"


def write_files(directory: Path, files: dict[str, str]) -> list[Path]:
    """Write `files` into `directory` (created if missing): each to a temporary file first, then
    all renamed into place, so no half-written file is ever left; nothing is written on error."""
    directory = Path(directory).expanduser().absolute()
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--output {directory}: exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RenderError(f"--output {directory}: cannot create it: {exc.strerror or exc}") from None
    staged: list[tuple[str, Path]] = []
    try:
        for fname, text in files.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{fname}.", suffix=".tmp", dir=directory)
            staged.append((tmp, directory / fname))
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)
        for tmp, target in staged:
            os.replace(tmp, target)
    except OSError as exc:
        for tmp, _ in staged:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise RenderError(f"--output {directory}: cannot write: {exc.strerror or exc}") from None
    return [target for _, target in staged]
