"""`molctl render k8s PROFILE --scheduler llm-d`: the engines as their own workload behind llm-d's
scheduler (the Gateway API Inference Extension's Endpoint Picker as llm-d-router v0.10 ships it),
and the proxy as a stateless tier of N replicas on the shared store whose upstream is the router.

What it renders (`llmd_objects`), in apply order:
- ConfigMap NAME-profile: the profile file (the proxy's --profiles-dir), as the per-pod stack's;
- Service NAME and Deployment NAME-proxy: --proxy-replicas proxies, upstream the router's Service
  NAME-pool-epp:8081 (the chart's Envoy listener), with `proxy.scheduler_objectives: NAME`, so
  each hop carries the headers the picker reads (`molctl.proxy.scheduler_hints`) and the
  proxy's own cross-replica affinity redirect is off;
- Deployment NAME-engine: --replicas vLLM pods running the profile's argv (the adapters as
  --lora-modules), on the pod IP, labelled for the pool, with a startup probe covering
  engine.start_timeout_s (an hour by default), the model and the engine's caches (vLLM's
  torch.compile and Triton caches, XDG_CACHE_HOME) on volumes; a rolling update never surges an
  extra pod (maxSurge 0: no second set of GPUs);
- InferencePool NAME-pool (inference.networking.k8s.io/v1) and one InferenceObjective
  (llm-d.ai/v1alpha2) per hop, NAME-route > NAME-answer > NAME-summary. The chart creates the same
  objects from the values (`router.inferencePool.create`, `router.inferenceObjectives`); these
  carry Helm's adoption metadata (release NAME-pool), so `kubectl apply` first and `helm
  install NAME-pool` after (or the other way round) leave one set of objects;
- and, beside them, the values of the llm-d-router-standalone chart (`llmd_values`): model
  servers, the pool, the objectives, the scorer plugins with weights and flow control.
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from molctl.errors import UsageError
from molctl.render import (
    DNS_LABEL,
    PRESTOP_DELAY_S,
    STARTUP_PERIOD_S,
    STOP_MARGIN_S,
    RenderOptions,
    Stack,
    default_shm_size,
    grace_period_s,
)

ROUTER_PORT = 8081  # the standalone chart's Envoy listener (router.extraServicePorts "http")
EPP_GRPC_PORT = 9002  # the EPP's ext-proc port (router.epp.extProcPort), the InferencePool's endpointPickerRef
ENGINE_CACHE_MOUNT = "/var/cache/molctl-engine"
# route above answer above summary: under load the EPP's flow control dispatches higher
# priorities first and sheds negative ones first (InferenceObjective.spec.priority)
OBJECTIVE_PRIORITIES = {"route": 2, "answer": 1, "summary": 0}
# Scorer weights of the EPP's default scheduling profile. queue 2, kv-cache 2, prefix-cache 3 are
# the chart's own (routerlib templates/_config.yaml, default-plugins.yaml); LoRA affinity 1 keeps
# an adapter's requests on pods that have it loaded (vllm:lora_requests_info) without outweighing
# load; session affinity 3 keeps a conversation's turns on the pod that holds their prefix.
SCORER_WEIGHTS = {
    "queue-scorer": 2,
    "kv-cache-utilization-scorer": 2,
    "prefix-cache-scorer": 3,
    "lora-affinity-scorer": 1,
    "session-affinity-scorer": 3,
}
SESSION_TTL_S = 3600  # a session's binding to its pod survives this long unused (the plugin's default: 300)
PLUGINS_FILE = "molctl-plugins.yaml"
VALUES_FILE = "llm-d-router-values.yaml"  # in DIR/helm/: `helm install NAME-pool ... -f` it


def llmd_objects(
    name: str,
    obj_name: str,
    stack: Stack,
    opts: RenderOptions,
    profile_map: dict[str, Any],
    proxy_container: dict[str, Any],
    proxy_volumes: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The objects, in apply order (see the module docstring); the profile's ConfigMap, the proxy
    container and its volumes as the per-pod stack has them (`molctl.render.k8s`)."""
    labels = base_labels(name, obj_name)
    meta = _meta(obj_name, labels, opts)
    proxy_labels = {**labels, "molctl.io/component": "proxy"}
    proxy_pod = {
        "terminationGracePeriodSeconds": math.ceil(PRESTOP_DELAY_S + opts.drain_timeout_s + STOP_MARGIN_S),
        "enableServiceLinks": False,
        "containers": [proxy_container],
        "volumes": proxy_volumes,
    }
    annotations = {"molctl.io/config-digest": stack.config["digest"]}
    proxy = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**meta, "name": f"{obj_name}-proxy", "labels": proxy_labels},
        "spec": {
            "replicas": opts.proxy_replicas,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "selector": {"matchLabels": _selector(obj_name, "proxy")},
            "template": {"metadata": {"labels": proxy_labels, "annotations": annotations}, "spec": proxy_pod},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": "ClusterIP",
            "selector": _selector(obj_name, "proxy"),
            "ports": [{"name": "http", "port": stack.profile.proxy.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    return [
        profile_map,
        service,
        proxy,
        _engines(name, obj_name, stack, opts, meta, annotations),
        inference_pool(obj_name, stack, opts),
        *inference_objectives(obj_name, opts),
    ]


def base_labels(name: str, obj_name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "molctl",
        "app.kubernetes.io/instance": obj_name,
        "app.kubernetes.io/managed-by": "molctl",
        "molctl.io/profile": name,
    }


def _meta(obj_name: str, labels: dict[str, str], opts: RenderOptions) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": obj_name, "labels": labels}
    if opts.namespace:
        meta["namespace"] = opts.namespace
    return meta


def _selector(obj_name: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": obj_name, "molctl.io/component": component}


def pool_name(obj_name: str) -> str:
    """The InferencePool's name: the chart's release name (its EPP runs --pool-name RELEASE)."""
    return f"{obj_name}-pool"


def router_upstream(obj_name: str, opts: RenderOptions) -> str:
    """The proxy's --upstream: the chart's EPP Service (RELEASE-epp), port ROUTER_PORT (its Envoy)."""
    host = f"{pool_name(obj_name)}-epp" + (f".{opts.namespace}.svc" if opts.namespace else "")
    return f"http://{host}:{ROUTER_PORT}"


def _engines(
    name: str, obj_name: str, stack: Stack, opts: RenderOptions, meta: dict[str, Any], annotations: dict[str, str]
) -> dict[str, Any]:
    profile = stack.profile
    labels = {**base_labels(name, obj_name), "molctl.io/component": "engine"}
    cache_env = {
        "XDG_CACHE_HOME": ENGINE_CACHE_MOUNT,
        "VLLM_CACHE_ROOT": f"{ENGINE_CACHE_MOUNT}/vllm",  # torch.compile artifacts (vllm/envs.py)
        "TRITON_CACHE_DIR": f"{ENGINE_CACHE_MOUNT}/triton",
    }
    # the caches on the pod's volume, not where `up` would keep them on this host; the profile's engine.env wins
    env = {**stack.engine_env, **cache_env, **profile.engine.env}
    health = {"httpGet": {"path": "/health", "port": "engine"}, "timeoutSeconds": 5}
    container: dict[str, Any] = {
        "name": "engine",
        "image": opts.engine_image or opts.image,
        "command": ["env", *[a for n in profile.engine.unset_env for a in ("-u", n)]],
        "args": [a.replace("$", "$$") for a in stack.engine_argv],
        "env": [{"name": k, "value": v.replace("$", "$$")} for k, v in env.items()],
        **({"envFrom": [{"secretRef": {"name": opts.engine_env_secret}}]} if opts.engine_env_secret else {}),
        "ports": [{"name": "engine", "containerPort": profile.engine.port, "protocol": "TCP"}],
        "volumeMounts": [
            {"name": "model", "mountPath": str(profile.model_root), "readOnly": True},
            {"name": "engine-cache", "mountPath": ENGINE_CACHE_MOUNT},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
        # the model load: up to engine.start_timeout_s (an hour by default) before liveness counts
        "startupProbe": {
            **health,
            "periodSeconds": STARTUP_PERIOD_S,
            "failureThreshold": math.ceil(profile.engine.start_timeout_s / STARTUP_PERIOD_S),
        },
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**health, "periodSeconds": 30, "failureThreshold": 3},
        # the EPP drops a terminating pod from the pool; in-flight requests finish within the grace
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_DELAY_S}}},
    }
    if profile.engine.gpus > 0:
        gpus = {"nvidia.com/gpu": profile.engine.gpus}
        container["resources"] = {"requests": dict(gpus), "limits": dict(gpus)}
    model: dict[str, Any] = {"name": "model"}
    if opts.model_pvc:
        model["persistentVolumeClaim"] = {"claimName": opts.model_pvc, "readOnly": True}
    else:
        model["hostPath"] = {"path": str(profile.model_root), "type": "Directory"}
    cache: dict[str, Any] = {"name": "engine-cache"}
    if opts.cache_pvc:
        cache["persistentVolumeClaim"] = {"claimName": opts.cache_pvc}
    else:
        cache["emptyDir"] = {}
    pod = {
        "terminationGracePeriodSeconds": grace_period_s(opts),
        "enableServiceLinks": False,
        "containers": [container],
        "volumes": [
            model,
            cache,
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size or default_shm_size(profile)}},
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**meta, "name": f"{obj_name}-engine", "labels": labels},
        "spec": {
            "replicas": opts.replicas,
            # one pod at a time, in place: a surge pod would need another engine.gpus GPUs
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "selector": {"matchLabels": _selector(obj_name, "engine")},
            "template": {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod},
        },
    }


def _helm_meta(name: str, obj_name: str, opts: RenderOptions) -> dict[str, Any]:
    """Metadata by which Helm (3.2+, helm/helm#7649) adopts an existing object into a release
    instead of refusing the install: the label managed-by Helm, the release's name and namespace."""
    meta: dict[str, Any] = {
        "labels": {"app.kubernetes.io/managed-by": "Helm", "molctl.io/instance": obj_name},
        "annotations": {
            "meta.helm.sh/release-name": pool_name(obj_name),
            "meta.helm.sh/release-namespace": opts.namespace or "default",
        },
    }
    if opts.namespace:
        meta["namespace"] = opts.namespace
    return {"name": name, **meta}


def inference_pool(obj_name: str, stack: Stack, opts: RenderOptions) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": _helm_meta(pool_name(obj_name), obj_name, opts),
        "spec": {
            "targetPorts": [{"number": stack.profile.engine.port}],
            "appProtocol": "http",
            "selector": {"matchLabels": _selector(obj_name, "engine")},
            "endpointPickerRef": {
                "name": f"{pool_name(obj_name)}-epp",
                "port": {"number": EPP_GRPC_PORT},
                "failureMode": "FailOpen",
            },
        },
    }


def objective_names(prefix: str) -> dict[str, str]:
    """hop -> the InferenceObjective's name (the proxy's x-llm-d-inference-objective)."""
    return {hop: f"{prefix}-{hop}" for hop in OBJECTIVE_PRIORITIES}


def inference_objectives(obj_name: str, opts: RenderOptions) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "llm-d.ai/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": _helm_meta(objective, obj_name, opts),
            "spec": {
                "priority": OBJECTIVE_PRIORITIES[hop],
                "poolRef": {"group": "inference.networking.k8s.io", "name": pool_name(obj_name)},
            },
        }
        for hop, objective in objective_names(obj_name).items()
    ]


def picker_config(stack: Stack) -> dict[str, Any]:
    """The EPP's EndpointPickerConfig (llm-d.ai/v1alpha1, apix/config/v1alpha1 in llm-d-router)."""
    session = {
        "type": "session-affinity-scorer",
        "parameters": {
            "strategy": "session_id",
            "sessionIdConfig": {"sources": [{"header": "x-session-id"}], "evictionTtlSeconds": SESSION_TTL_S},
        },
    }
    plugins = [{"type": t} for t in SCORER_WEIGHTS if t != "session-affinity-scorer"] + [session]
    plugins += [
        {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics"}},
        {"type": "core-metrics-extractor"},
    ]
    return {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "featureGates": ["flowControl"],
        "plugins": plugins,
        "schedulingProfiles": [
            {"name": "default", "plugins": [{"pluginRef": t, "weight": w} for t, w in SCORER_WEIGHTS.items()]}
        ],
        # A request waits in the EPP's queue while no pod can take it, up to this (the EPP's
        # default is 60 s): the engines' start (engine.start_timeout_s, an hour by default) is
        # waited out rather than shed as 429/503 x-llm-d-request-dropped-reason.
        "flowControl": {"defaultRequestTTL": f"{math.ceil(stack.profile.engine.start_timeout_s)}s"},
    }


def llmd_values(obj_name: str, stack: Stack) -> dict[str, Any]:
    """The llm-d-router-standalone chart's values (router.*): EPP with an Envoy sidecar."""
    return {
        "router": {
            "modelServers": {
                "type": _model_server(stack),
                "protocol": "http",
                "targetPorts": [{"number": stack.profile.engine.port}],
                "matchLabels": _selector(obj_name, "engine"),
            },
            "inferencePool": {"create": True, "failureMode": "FailOpen"},
            "inferenceObjectives": [
                {"name": objective, "priority": OBJECTIVE_PRIORITIES[hop]}
                for hop, objective in objective_names(obj_name).items()
            ],
            "extraServicePorts": [{"name": "http", "port": ROUTER_PORT, "protocol": "TCP", "targetPort": ROUTER_PORT}],
            "proxy": {"enabled": True, "proxyType": "envoy", "mode": "sidecar"},
            "epp": {
                # the session-affinity scorer is an Alpha plugin in v0.10.0: the EPP refuses to start
                # with it unless --allow-experimental-plugins (plugin/registry.go, ValidatePluginStability)
                "flags": {"allow-experimental-plugins": True},
                "pluginsConfigFile": PLUGINS_FILE,
                "pluginsCustomConfig": {
                    PLUGINS_FILE: yaml.safe_dump(picker_config(stack), sort_keys=False, default_flow_style=False)
                },
            },
        }
    }


def proxy_share(profile: Any, opts: RenderOptions) -> int:
    """`proxy.max_inflight` of each proxy when the profile sets none: its share of the answer hops
    all the engines run at once (--replicas x the engine's max-num-seqs, over --proxy-replicas),
    so the proxies together keep every engine busy and the EPP's flow control queues the rest (the
    proxy's own default, one engine's max-num-seqs, would leave engines idle behind few proxies)."""
    from molctl.engines import get_engine

    running = get_engine(profile.engine.kind).max_running(profile)
    return max(1, math.ceil(opts.replicas * running / max(1, opts.proxy_replicas)))


def _model_server(stack: Stack) -> str | None:
    from molctl.engines import get_engine

    return get_engine(stack.profile.engine.kind).llmd_model_server


def check_llmd(stack: Stack, opts: RenderOptions) -> None:
    """llm-d's picker scores vLLM pods (its metrics, its LoRA info): a SGLang profile is refused."""
    if _model_server(stack) is None:
        raise UsageError(
            f"--scheduler llm-d: the profile's engine.kind is {stack.profile.engine.kind!r}; llm-d's scheduler "
            "is rendered for vLLM engines only (use the default --scheduler stack)"
        )
    if opts.proxy_replicas < 1:
        raise UsageError(f"--proxy-replicas {opts.proxy_replicas}: expected at least 1")
    if opts.cache_pvc is not None and not DNS_LABEL.match(opts.cache_pvc):
        raise UsageError(f"--cache-pvc {opts.cache_pvc!r}: expected a DNS label (lowercase letters, digits, '-')")
