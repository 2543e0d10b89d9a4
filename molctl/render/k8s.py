"""`molctl render k8s PROFILE`: the ConfigMap, Service and StatefulSet of one stack (`render_k8s`),
as one YAML stream (`k8s_stream`) or one file per object (`k8s_files`). The pod layout and its
termination are described in `molctl.render`."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import yaml

from molctl import __version__, stackconfig
from molctl.errors import ProfileError, UsageError
from molctl.lifecycle.launch import engine_upstream
from molctl.profiles import Profile
from molctl.render import (
    DNS_LABEL,
    DRAIN_SEEN_WITHIN_S,
    KEYS_MOUNT,
    KEYS_SECRET_KEY,
    LABEL_VALUE,
    MAX_NAME,
    MAX_REPLICAS,
    OBJECT_NAME,
    PRESTOP_DELAY_S,
    PROBE_SCRIPT,
    PROFILES_MOUNT,
    QUANTITY,
    STARTUP_PERIOD_S,
    STATE_MOUNT,
    STOP_MARGIN_S,
    STORE_PASSWORD_ENV,
    WAIT_GONE_SCRIPT,
    RenderOptions,
    Stack,
    _check_common,
    _store_overrides,
    default_shm_size,
    grace_period_s,
    load_stack,
)


def render_k8s(name: str, dirs: list[Path], opts: RenderOptions) -> tuple[list[dict[str, Any]], list[str]]:
    """The objects, in apply order (ConfigMap, Service, StatefulSet; with --scheduler llm-d those of
    `molctl.render.llmd`), and warnings for the operator."""
    objects, _, warnings = _render(name, dirs, opts)
    return objects, warnings


def render_k8s_llmd(
    name: str, dirs: list[Path], opts: RenderOptions
) -> tuple[list[dict[str, Any]], dict[str, str], list[str]]:
    """--scheduler llm-d: the objects, the router chart's values file ({file name: text}) and warnings."""
    from molctl.render.llmd import VALUES_FILE, llmd_values

    objects, stack, warnings = _render(name, dirs, opts)
    obj_name = opts.name or f"molctl-{name}"
    header = f"# molctl {__version__}: molctl render k8s {name} --scheduler llm-d (llm-d-router-standalone v0.10.0)\n"
    return objects, {VALUES_FILE: header + k8s_yaml([llmd_values(obj_name, stack)])[0]}, warnings


def _render(name: str, dirs: list[Path], opts: RenderOptions) -> tuple[list[dict[str, Any]], Stack, list[str]]:
    _check_k8s_options(opts)
    obj_name = opts.name or f"molctl-{name}"
    password_ref = _secret_ref("--store-password-secret", opts.store_password_secret, "password")
    llmd = opts.scheduler == "llm-d"
    stack = _k8s_stack(name, dirs, opts, obj_name if llmd else None)
    if opts.name is None:  # checked once the profile is known to exist (an unknown one is exit 3)
        _check_object_name(f"the default name {obj_name!r} (molctl-PROFILE) is not usable: give --name;", obj_name)
    if not LABEL_VALUE.match(name):
        raise ProfileError(
            f"profile {name!r}: its name is the label molctl.io/profile of every object, and is no "
            "Kubernetes label value (at most 63 characters, ending in a letter or digit): rename the "
            "profile"
        )
    if llmd:
        from molctl.engines import get_engine
        from molctl.render.llmd import base_labels, check_llmd, llmd_objects

        check_llmd(stack, opts)
        meta = {"name": obj_name, "labels": base_labels(name, obj_name)}
        if opts.namespace:
            meta["namespace"] = opts.namespace
        proxy = _proxy_container(stack, opts, get_engine(stack.profile.engine.kind), password_ref)
        volumes = [v for v in _volumes(stack.profile, opts, obj_name) if v["name"] in ("profile", "state", "api-keys")]
        objects = llmd_objects(name, obj_name, stack, opts, config_map(name, obj_name, stack, meta), proxy, volumes)
    else:
        objects = _k8s_objects(name, obj_name, stack, opts, password_ref)
    warnings = []
    replicas = opts.proxy_replicas if llmd else opts.replicas
    if replicas > 1 and not stack.profile.proxy.store.startswith(("redis://", "rediss://")):
        warnings.append(
            f"{'--proxy-replicas' if llmd else '--replicas'} {replicas} with proxy.store "
            f"{stack.profile.proxy.store!r}: each pod keeps its own "
            "conversations and responses; a turn that reaches another pod loses them (use --store redis://...)"
        )
    if not llmd:  # with llm-d the scheduler places the hops, not the proxies' affinity
        warnings += _affinity_warnings(stack.profile, opts)
    return objects, stack, warnings


SCHEDULERS = ("stack", "llm-d")


def _check_k8s_options(opts: RenderOptions) -> None:
    _check_common(opts)
    if opts.scheduler not in SCHEDULERS:
        raise UsageError(f"--scheduler {opts.scheduler!r}: expected one of {', '.join(SCHEDULERS)}")
    if opts.replicas < 1:
        raise UsageError(f"--replicas {opts.replicas}: expected at least 1")
    if opts.replicas > MAX_REPLICAS:  # spec.replicas is an int32: the API server would refuse the object
        raise UsageError(f"--replicas {opts.replicas}: expected 1 to {MAX_REPLICAS}")
    if not opts.image:
        raise UsageError("--image is required: the container image with molctl (and the engine, unless --engine-image)")
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


def _k8s_stack(name: str, dirs: list[Path], opts: RenderOptions, llmd_name: str | None = None) -> Stack:
    """The stack as a pod runs it: the proxy on the pod IP, the mounts' paths for keys, state and
    profiles. `llmd_name` (--scheduler llm-d, the objects' name): the engine on its pod IP too (the
    router reaches it there), the proxy's upstream the router and its hops the scheduler's
    headers (`proxy.scheduler_objectives`)."""
    if opts.allow_unauthenticated:
        key_args = ["--allow-unauthenticated"]
    else:
        key_args = ["--api-key-file", f"{KEYS_MOUNT}/{KEYS_SECRET_KEY}"]
    # The proxy listens on the pod IP (the Service reaches it there), and so does its metrics
    # listener where the profile has one (a scrape reaches the pod IP, the Service never exposes
    # it); the user's --set may say otherwise.
    overrides = [("proxy.host", "0.0.0.0"), *opts.overrides, *_store_overrides(opts)]
    upstream = None
    if llmd_name is not None:
        from molctl.render.llmd import router_upstream

        overrides[1:1] = [("engine.host", "0.0.0.0"), ("proxy.scheduler_objectives", llmd_name)]
        upstream = router_upstream(llmd_name, opts)
    profile = stackconfig.load(name, dirs, overrides)[0]
    if llmd_name is not None and profile.proxy.max_inflight is None:
        from molctl.render.llmd import proxy_share

        # each proxy's share of all the engines' running slots (the default is one engine's)
        overrides.insert(1, ("proxy.max_inflight", proxy_share(profile, opts)))
    if profile.proxy.metrics_port:
        overrides.insert(1, ("proxy.metrics_host", "0.0.0.0"))
    return load_stack(
        name,
        dirs,
        overrides,
        opts,
        key_args=key_args,
        python=opts.python,
        state_dir=Path(STATE_MOUNT),
        proxy_profiles_dirs=[Path(PROFILES_MOUNT)],
        default_engine_python=opts.python,
        upstream=upstream,
    )


def config_map(name: str, obj_name: str, stack: Stack, meta: dict[str, Any]) -> dict[str, Any]:
    """The profile file, mounted where the proxy's --profiles-dir points: the proxy loads it with
    the same overrides as `up`."""
    source = Path(stack.config["source"])
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**meta, "name": f"{obj_name}-profile"},
        "data": {f"{name}.yaml": source.read_text(encoding="utf-8")},
    }


def _k8s_objects(
    name: str, obj_name: str, stack: Stack, opts: RenderOptions, password_ref: dict[str, str] | None
) -> list[dict[str, Any]]:
    """The ConfigMap (the profile file), the Service and the StatefulSet, in apply order."""
    labels = {
        "app.kubernetes.io/name": "molctl",
        "app.kubernetes.io/instance": obj_name,
        "app.kubernetes.io/managed-by": "molctl",
        "molctl.io/profile": name,
    }
    meta = {"name": obj_name, "labels": labels}
    if opts.namespace:
        meta["namespace"] = opts.namespace
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
    return [config_map(name, obj_name, stack, meta), service, statefulset]


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

    engine = get_engine(stack.profile.engine.kind)
    return {
        "terminationGracePeriodSeconds": grace_period_s(opts),
        "enableServiceLinks": False,  # no FOO_PORT=tcp://... variables from other Services in the engine's environment
        "containers": [_engine_container(stack, opts, engine), _proxy_container(stack, opts, engine, password_ref)],
        "volumes": [*_volumes(stack.profile, opts, obj_name), _cache_volume(obj_name)],
    }


def _engine_container(stack: Stack, opts: RenderOptions, engine) -> dict[str, Any]:
    profile = stack.profile
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
            {"name": "engine-cache", "mountPath": str(stack.cache_dir)},
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
    return engine_container


def _proxy_container(stack: Stack, opts: RenderOptions, engine, password_ref: dict[str, str] | None) -> dict[str, Any]:
    profile = stack.profile
    proxy_port = profile.proxy.port
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
    return proxy_container


def _cache_volume(obj_name: str) -> dict[str, Any]:
    """The engine's compile and kernel caches (molctl.enginecache), kept on the node across pod
    restarts: a restart on the same node skips torch.compile and kernel autotuning."""
    return {"name": "engine-cache", "hostPath": {"path": f"/var/cache/molctl/{obj_name}", "type": "DirectoryOrCreate"}}


def _volumes(profile: Profile, opts: RenderOptions, obj_name: str) -> list[dict[str, Any]]:
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
    return volumes


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
