"""`molctl render k8s|systemd PROFILE`: Kubernetes manifests or systemd units for one stack, from
the same profile, overrides and argv code as `molctl up` (molctl.start.engine_argv and
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
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from molctl import __version__, stackconfig
from molctl.errors import MolctlError, ProfileError, UsageError
from molctl.profiles import Profile
from molctl.readiness import proxy_url
from molctl.redaction import (
    URL_CREDENTIALS_RE,
    is_secret_name,
    secret_engine_args,
)  # what `lock` redacts, render refuses
from molctl.start import PROXY_READY_TIMEOUT_S, UpOptions, engine_argv, engine_env, engine_upstream, proxy_argv
from molctl.stop import ENGINE_STOP_TIMEOUT_S

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
) -> Stack:
    """The profile with `overrides` (and `engine.python` = `default_engine_python` when the
    profile names none), and the engine and proxy argv `up` builds from it."""
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
    proxy = proxy_argv(profile, up_opts, key_args, engine_upstream(profile), python=python, state_dir=state_dir)
    return Stack(profile, config, engine_argv(profile), engine_env(profile, base={}), proxy)


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


# ------------------------------------------------------------------------------------ Kubernetes


def render_k8s(name: str, dirs: list[Path], opts: RenderOptions) -> tuple[list[dict[str, Any]], list[str]]:
    """The objects, in apply order (ConfigMap, Service, StatefulSet), and warnings for the operator."""
    _check_common(opts)
    if opts.replicas < 1:
        raise UsageError(f"--replicas {opts.replicas}: expected at least 1")
    if opts.replicas > MAX_REPLICAS:  # spec.replicas is an int32: the API server would refuse the object
        raise UsageError(f"--replicas {opts.replicas}: expected 1 to {MAX_REPLICAS}")
    if not opts.image:
        raise UsageError("--image is required: the container image with molctl (and the engine, unless --engine-image)")
    obj_name = opts.name or f"molctl-{name}"
    if opts.name is not None:
        _check_object_name("--name", opts.name)
    for label, value in (
        ("--namespace", opts.namespace),
        ("--api-key-secret", opts.api_key_secret),
        ("--model-pvc", opts.model_pvc),
        ("--engine-env-secret", opts.engine_env_secret),
    ):
        if value is not None and not DNS_LABEL.match(value):
            raise UsageError(f"{label} {value!r}: expected a DNS label (lowercase letters, digits, '-', at most 63)")
    if opts.shm_size is not None and not QUANTITY.match(opts.shm_size):
        raise UsageError(f"--shm-size {opts.shm_size!r}: expected a Kubernetes quantity, e.g. 16Gi")
    password_ref = _secret_ref("--store-password-secret", opts.store_password_secret, "password")
    if opts.allow_unauthenticated:
        key_args = ["--allow-unauthenticated"]
    else:
        key_args = ["--api-key-file", f"{KEYS_MOUNT}/{KEYS_SECRET_KEY}"]
    # The proxy listens on the pod IP (the Service reaches it there), and so does its metrics
    # listener where the profile has one (a scrape reaches the pod IP, the Service never exposes
    # it); the user's --set may say otherwise.
    overrides = [("proxy.host", "0.0.0.0"), *opts.overrides, *_store_overrides(opts)]
    if stackconfig.load(name, dirs, overrides)[0].proxy.metrics_port:
        overrides.insert(1, ("proxy.metrics_host", "0.0.0.0"))
    stack = load_stack(
        name,
        dirs,
        overrides,
        opts,
        key_args=key_args,
        python=opts.python,
        state_dir=Path(STATE_MOUNT),
        proxy_profiles_dirs=[Path(PROFILES_MOUNT)],
        default_engine_python=opts.python,
    )
    if opts.name is None:  # checked once the profile is known to exist (an unknown one is exit 3)
        _check_object_name(f"the default name {obj_name!r} (molctl-PROFILE) is not usable: give --name;", obj_name)
    if not LABEL_VALUE.match(name):
        raise ProfileError(
            f"profile {name!r}: its name is the label molctl.io/profile of every object, and is no "
            "Kubernetes label value (at most 63 characters, ending in a letter or digit): rename the "
            "profile"
        )
    labels = {
        "app.kubernetes.io/name": "molctl",
        "app.kubernetes.io/instance": obj_name,
        "app.kubernetes.io/managed-by": "molctl",
        "molctl.io/profile": name,
    }
    meta = {"name": obj_name, "labels": labels}
    if opts.namespace:
        meta["namespace"] = opts.namespace
    source = Path(stack.config["source"])  # the file itself: the proxy loads it with the same overrides as `up`
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**meta, "name": f"{obj_name}-profile"},
        "data": {f"{name}.yaml": source.read_text(encoding="utf-8")},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": "ClusterIP",
            "selector": {"app.kubernetes.io/instance": obj_name},
            "ports": [{"name": "http", "port": stack.profile.proxy.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    pod = _pod_spec(stack, opts, obj_name, password_ref)
    annotations = {"molctl.io/config-digest": stack.config["digest"]}  # a changed configuration rolls the pods
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta,
        "spec": {
            "serviceName": obj_name,
            "replicas": opts.replicas,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": {"app.kubernetes.io/instance": obj_name}},
            "template": {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod},
        },
    }
    warnings = []
    if opts.replicas > 1 and not stack.profile.proxy.store.startswith(("redis://", "rediss://")):
        warnings.append(
            f"--replicas {opts.replicas} with proxy.store {stack.profile.proxy.store!r}: each pod keeps its own "
            "conversations and responses; a turn that reaches another pod loses them (use --store redis://...)"
        )
    warnings += _affinity_warnings(stack.profile, opts)
    return [config_map, service, statefulset], warnings


def _check_object_name(label: str, value: str) -> None:
    """NAME, or the default molctl-PROFILE: what the API server and the StatefulSet controller take."""
    if OBJECT_NAME.match(value) and len(value) <= MAX_NAME:
        return
    shown = label if label.endswith(";") else f"{label} {value!r}:"
    raise UsageError(
        f"{shown} expected at most {MAX_NAME} lowercase letters, digits and '-', starting with a letter "
        "and ending with a letter or digit (a Service name; each pod of the StatefulSet carries the label "
        f"controller-revision-hash=NAME-<10 characters>, at most 63)"
    )


def _affinity_warnings(profile: Profile, opts: RenderOptions) -> list[str]:
    """Replicas on a shared store whose engines their peers cannot reach: the engine on the pod's
    loopback, or advertised as the proxy's --upstream (the pod's own loopback). Peers then send a
    conversation's hops to their own engine while recording them as the owner's, or get refused."""
    if opts.replicas < 2 or not profile.proxy.store.startswith(("redis://", "rediss://")):
        return []
    advertised = profile.proxy.advertise_upstream
    for i, arg in enumerate(opts.proxy_args):
        if arg.startswith("--advertise-upstream="):
            advertised = arg.partition("=")[2]
        elif arg == "--advertise-upstream" and i + 1 < len(opts.proxy_args):
            advertised = opts.proxy_args[i + 1]
    engine_loopback = profile.engine.host in ("localhost", "::1") or profile.engine.host.startswith("127.")
    if advertised and not engine_loopback:
        return []
    why = (
        (f"the engine listens on {profile.engine.host}" if engine_loopback else "")
        + (" and " if engine_loopback and not advertised else "")
        + ("" if advertised else f"each proxy advertises its engine as {engine_upstream(profile)} (its own pod)")
    )
    return [
        f"--replicas {opts.replicas} on the shared store {profile.proxy.store}: {why}, so a pod cannot reach its "
        "peers' engines and conversation affinity is off (prefix caches are not reused across pods): add --set "
        f"engine.host=0.0.0.0 --proxy-arg='--advertise-upstream=http://$(POD_IP):{profile.engine.port}' (and a "
        "NetworkPolicy that keeps the engine port to the pods)"
    ]


def k8s_escape(argv: list[str]) -> list[str]:
    """`$` doubled: Kubernetes expands `$(VAR)` in command, args and env values and reads `$$` as
    `$`, so the container runs exactly `argv` (gets exactly the value). The --proxy-arg values are
    not escaped: `$(POD_NAME)` in them is meant to expand."""
    return [a.replace("$", "$$") for a in argv]


def _secret_ref(label: str, spec: str | None, default_key: str) -> dict[str, str] | None:
    if spec is None:
        return None
    secret, _, key = spec.partition(":")
    if not DNS_LABEL.match(secret) or (key and not re.match(r"^[-._a-zA-Z0-9]+$", key)):
        raise UsageError(
            f"{label} {spec!r}: expected SECRET or SECRET:KEY (a DNS label, a key of letters, digits, '-._')"
        )
    return {"name": secret, "key": key or default_key}


def _pod_spec(stack: Stack, opts: RenderOptions, obj_name: str, password_ref: dict[str, str] | None) -> dict[str, Any]:
    from molctl.engines import get_engine

    profile = stack.profile
    engine = get_engine(profile.engine.kind)
    engine_python = stack.engine_argv[0]
    engine_health = f"{engine_upstream(profile)}/health"
    probe_timeout = math.ceil(engine.health_timeout_s) + 4  # the exec's own Python start-up included
    # A failed liveness or startup probe restarts the engine container alone: within this grace (the
    # preStop's wait for a drain that does not come, the engine's stop, the margin), not the pod's,
    # which is sized for the proxy's whole drain.
    exec_probe = {
        "exec": {"command": [engine_python, "-c", PROBE_SCRIPT, engine_health, str(engine.health_timeout_s + 2)]},
        "timeoutSeconds": probe_timeout,
        "terminationGracePeriodSeconds": math.ceil(DRAIN_SEEN_WITHIN_S + opts.stop_timeout_s + STOP_MARGIN_S),
    }
    proxy_port = profile.proxy.port
    # no secrets (load_stack refuses them); `$` doubled: Kubernetes expands `$(VAR)` in env values as in args
    env_vars = [{"name": k, "value": k8s_escape([v])[0]} for k, v in stack.engine_env.items()]
    engine_container = {
        "name": "engine",
        "image": opts.engine_image or opts.image,
        # `env -u NAME` for each engine.unset_env: the image's environment without them, as `up` runs the engine
        "command": ["env", *[a for n in profile.engine.unset_env for a in ("-u", n)]],
        "args": k8s_escape(stack.engine_argv),
        "env": env_vars,
        **({"envFrom": [{"secretRef": {"name": opts.engine_env_secret}}]} if opts.engine_env_secret else {}),
        "ports": [{"name": "engine", "containerPort": profile.engine.port, "protocol": "TCP"}],
        "volumeMounts": [
            {"name": "model", "mountPath": str(profile.model_root), "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
        "startupProbe": {
            **exec_probe,
            "periodSeconds": STARTUP_PERIOD_S,
            "failureThreshold": math.ceil(profile.engine.start_timeout_s / STARTUP_PERIOD_S),
        },
        "livenessProbe": {**exec_probe, "periodSeconds": 30, "failureThreshold": 3},
        "lifecycle": {
            "preStop": {
                "exec": {
                    "command": [
                        engine_python,
                        "-c",
                        WAIT_GONE_SCRIPT,
                        str(DRAIN_SEEN_WITHIN_S),
                        f"http://127.0.0.1:{proxy_port}/health",
                        str(math.ceil(PRESTOP_DELAY_S + opts.drain_timeout_s + STOP_MARGIN_S)),
                    ]
                }
            }
        },
    }
    if profile.engine.gpus > 0:
        gpus = {"nvidia.com/gpu": profile.engine.gpus}
        engine_container["resources"] = {"requests": dict(gpus), "limits": dict(gpus)}
    downward = [
        {"name": n, "valueFrom": {"fieldRef": {"fieldPath": f}}}
        for n, f in (("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace"), ("POD_IP", "status.podIP"))
    ]
    if password_ref is not None:
        downward.append({"name": STORE_PASSWORD_ENV, "valueFrom": {"secretKeyRef": password_ref}})
    ports = [{"name": "http", "containerPort": proxy_port, "protocol": "TCP"}]
    metrics_port = profile.proxy.metrics_port  # the proxy's metrics listener (on the pod IP), where the profile has one
    if metrics_port:
        ports.append({"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"})
    readyz_timeout = math.ceil(max(2.0, engine.health_timeout_s)) + 3
    proxy_mounts = [
        {"name": "profile", "mountPath": PROFILES_MOUNT, "readOnly": True},
        {"name": "state", "mountPath": STATE_MOUNT},
    ]
    if not opts.allow_unauthenticated:
        proxy_mounts.append({"name": "api-keys", "mountPath": KEYS_MOUNT, "readOnly": True})
    proxy_container = {
        "name": "proxy",
        "image": opts.image,
        "command": ["env"],
        "args": [*k8s_escape(stack.proxy_argv), *opts.proxy_args],
        "env": downward,
        "ports": ports,
        "volumeMounts": proxy_mounts,
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 5,
            "timeoutSeconds": readyz_timeout,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_DELAY_S}}},
    }
    model_volume: dict[str, Any] = {"name": "model"}
    if opts.model_pvc:
        model_volume["persistentVolumeClaim"] = {"claimName": opts.model_pvc, "readOnly": True}
    else:
        model_volume["hostPath"] = {"path": str(profile.model_root), "type": "Directory"}
    volumes = [
        model_volume,
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size or default_shm_size(profile)}},
        {"name": "profile", "configMap": {"name": f"{obj_name}-profile"}},
        {"name": "state", "emptyDir": {}},
    ]
    if not opts.allow_unauthenticated:
        secret = opts.api_key_secret or f"{obj_name}-api-keys"
        volumes.append(
            {
                "name": "api-keys",
                "secret": {
                    "secretName": secret,
                    "defaultMode": 0o440,
                    "items": [{"key": KEYS_SECRET_KEY, "path": KEYS_SECRET_KEY}],
                },
            }
        )
    return {
        "terminationGracePeriodSeconds": grace_period_s(opts),
        "enableServiceLinks": False,  # no FOO_PORT=tcp://... variables from other Services in the engine's environment
        "containers": [engine_container, proxy_container],
        "volumes": volumes,
    }


class _Dumper(yaml.SafeDumper):
    """Block YAML without anchors (`&id001`), multi-line strings (the profile file, the preStop
    script) as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)


def k8s_yaml(objects: list[dict[str, Any]]) -> list[str]:
    return [
        yaml.dump(o, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1_000_000, allow_unicode=True)
        for o in objects
    ]


def k8s_stream(name: str, objects: list[dict[str, Any]]) -> str:
    """One YAML stream, like `helm template`."""
    header = f"# molctl {__version__}: molctl render k8s {name}\n"
    return header + "".join(f"---\n{doc}" for doc in k8s_yaml(objects))


def k8s_files(objects: list[dict[str, Any]]) -> dict[str, str]:
    """One file per object: `KIND-NAME.yaml` (kind in lowercase)."""
    return {
        f"{o['kind'].lower()}-{o['metadata']['name']}.yaml": doc
        for o, doc in zip(objects, k8s_yaml(objects), strict=True)
    }


# ------------------------------------------------------------------------------------ systemd


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
    wait = [sys.executable, "-m", "molctl.waitready"]
    for d in profiles_dirs:
        wait += ["--profiles-dir", str(d)]
    set_json = stack.proxy_argv[stack.proxy_argv.index("--set-json") + 1] if "--set-json" in stack.proxy_argv else None
    engine_wait = [*wait, "engine", name, "--timeout", f"{profile.engine.start_timeout_s:g}"]
    if set_json:
        engine_wait += ["--set-json", set_json]
    proxy_wait = [*wait, "url", f"{proxy_url(profile)}/readyz", "--timeout", f"{PROXY_READY_TIMEOUT_S:g}"]
    user = [f"User={opts.user}"] if opts.user else []
    engine_lines = [
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
    proxy_lines = [
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
    for line in (*engine_lines, *proxy_lines):  # a line break would end the directive and start another one
        at = min((i for i in (line.find("\n"), line.find("\r")) if i >= 0), default=-1)
        if at >= 0:
            raise UsageError(
                f"systemd: {line.split('=', 1)[0]}= would hold a line break (which would start another "
                f"directive), at ...{line[max(0, at - 60) : at + 60]!r}..."
            )
    return {engine_unit: "\n".join(engine_lines) + "\n", proxy_unit: "\n".join(proxy_lines) + "\n"}


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


# ------------------------------------------------------------------------------------ output


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
