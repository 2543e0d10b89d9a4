"""`molctl render k8s|systemd PROFILE` (`render_app`): the options, and the output as one stream
or one file per object."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from molctl.cli.base import DRAIN_OPT, MODEL_ROOT_OPT, SET_OPT, STOP_OPT, UNAUTH_OPT, handle_errors, overrides_from
from molctl.errors import UsageError

render_app = typer.Typer(
    help="Kubernetes manifests or systemd units for a stack, from the profile `up` uses "
    "(same argv; nothing is started, the state dir is not touched).",
    no_args_is_help=True,
)


RENDER_OUTPUT_OPT = typer.Option(
    None,
    "--output",
    "-o",
    metavar="DIR",
    help="Write one file per object/unit into DIR (created if missing) instead of stdout.",
)


RENDER_STORE_OPT = typer.Option(
    None,
    "--store",
    metavar="URL",
    help="The proxy's state store (proxy.store), e.g. redis://redis:6379/0 for replicas that share it.",
)


RENDER_PROXY_ARG_OPT = typer.Option(
    [],
    "--proxy-arg",
    metavar="ARG",
    help="Append ARG to the proxy's argv (repeatable), e.g. --proxy-arg=--replica-id=$(POD_NAME).",
)


def _render_out(files: dict[str, str], stream: str, output: Optional[Path], warnings: list[str]) -> None:
    from molctl.output import Output
    from molctl.render import write_files

    out = Output()
    for warning in warnings:
        out.warn(warning)
    if output is None:
        out.raw(stream)
        return
    for path in write_files(output, files):
        out.raw(f"wrote {path}\n")


@render_app.command("k8s")
@handle_errors
def render_k8s_cmd(
    ctx: typer.Context,
    profile: str = typer.Argument(..., help="Profile to render (see `molctl profiles`)."),
    image: Optional[str] = typer.Option(
        None, "--image", help="Container image with molctl (and the engine, unless --engine-image). Required."
    ),
    engine_image: Optional[str] = typer.Option(
        None, "--engine-image", help="Image of the engine container (default: --image)."
    ),
    python: str = typer.Option(
        "python3", "--python", help="The interpreter in the image(s); the engine's unless engine.python is set."
    ),
    replicas: int = typer.Option(
        1, "--replicas", help="Pods, each a whole stack (>= 1); with --scheduler llm-d: engine pods."
    ),
    scheduler: str = typer.Option(
        "stack",
        "--scheduler",
        metavar="stack|llm-d",
        help="stack (default): each pod a whole stack (engine + proxy), the proxies' own conversation "
        "affinity on a shared store; for one to a few engines, no cluster add-ons. llm-d: the engines "
        "(vLLM) their own Deployment behind llm-d's scheduler (Gateway API Inference Extension CRDs and the "
        "llm-d-router-standalone chart, values written to DIR/helm/), the proxy a stateless Deployment; for "
        "many engines, where queue, KV-cache, prefix and LoRA-aware placement pays. Needs --output.",
    ),
    proxy_replicas: Optional[int] = typer.Option(
        None, "--proxy-replicas", help="--scheduler llm-d: proxy pods (>= 1, default 2)."
    ),
    cache_pvc: Optional[str] = typer.Option(
        None,
        "--cache-pvc",
        metavar="CLAIM",
        help="--scheduler llm-d: the engines' compile caches on this PersistentVolumeClaim, ReadWriteMany (every "
        "engine pod mounts it; default: an emptyDir per pod).",
    ),
    namespace: Optional[str] = typer.Option(None, "--namespace", "-n", help="metadata.namespace of every object."),
    name: Optional[str] = typer.Option(None, "--name", help="Name of the objects (default molctl-PROFILE)."),
    model_root: Optional[Path] = MODEL_ROOT_OPT,
    set_: List[str] = SET_OPT,
    model_pvc: Optional[str] = typer.Option(
        None,
        "--model-pvc",
        metavar="CLAIM",
        help="Mount the model root from this PersistentVolumeClaim (default: a hostPath at model_root).",
    ),
    shm_size: Optional[str] = typer.Option(
        None, "--shm-size", help="/dev/shm size (default 2Gi per GPU, 1Gi without GPUs)."
    ),
    engine_env_secret: Optional[str] = typer.Option(
        None,
        "--engine-env-secret",
        metavar="SECRET",
        help="Every key of this Secret becomes an engine variable (e.g. HF_TOKEN).",
    ),
    api_key_secret: Optional[str] = typer.Option(
        None,
        "--api-key-secret",
        metavar="SECRET",
        help="Secret whose key `api-keys` holds the proxy's keys (default NAME-api-keys).",
    ),
    allow_unauthenticated: bool = UNAUTH_OPT,
    store: Optional[str] = RENDER_STORE_OPT,
    store_password_secret: Optional[str] = typer.Option(
        None,
        "--store-password-secret",
        metavar="SECRET[:KEY]",
        help="MOLCTL_STORE_PASSWORD from this Secret (key default: password).",
    ),
    proxy_arg: List[str] = RENDER_PROXY_ARG_OPT,
    drain_timeout: float = DRAIN_OPT,
    stop_timeout: float = STOP_OPT,
    output: Optional[Path] = RENDER_OUTPUT_OPT,
) -> None:
    """ConfigMap (the profile), Service (the proxy port) and StatefulSet (engine + proxy per pod) as YAML, like
    `helm template`; with --scheduler llm-d: engine and proxy Deployments, InferencePool, InferenceObjectives
    and the llm-d router chart's values."""
    from molctl.render import RenderOptions
    from molctl.render.k8s import k8s_files, k8s_stream, render_k8s, render_k8s_llmd

    opts = RenderOptions(
        overrides=overrides_from(model_root, set_),
        drain_timeout_s=drain_timeout,
        stop_timeout_s=stop_timeout,
        store=store,
        allow_unauthenticated=allow_unauthenticated,
        proxy_args=list(proxy_arg),
        image=image,
        engine_image=engine_image,
        python=python,
        replicas=replicas,
        namespace=namespace,
        name=name,
        api_key_secret=api_key_secret,
        store_password_secret=store_password_secret,
        model_pvc=model_pvc,
        shm_size=shm_size,
        engine_env_secret=engine_env_secret,
        scheduler=scheduler,
        proxy_replicas=2 if proxy_replicas is None else proxy_replicas,
        cache_pvc=cache_pvc,
    )
    if scheduler != "llm-d":
        for label, given in (("--proxy-replicas", proxy_replicas), ("--cache-pvc", cache_pvc)):
            if given is not None:
                raise UsageError(
                    f"{label}: only with --scheduler llm-d (each pod of the default stack has its own proxy)"
                )
        objects, warnings = render_k8s(profile, ctx.obj.dirs(), opts)
        _render_out(k8s_files(objects), k8s_stream(profile, objects), output, warnings)
        return
    if output is None:
        raise UsageError(
            "--scheduler llm-d: give --output DIR (the manifests, and the router chart's values in DIR/helm/)"
        )
    objects, values, warnings = render_k8s_llmd(profile, ctx.obj.dirs(), opts)
    _render_out(k8s_files(objects), "", output, warnings)
    _render_out(values, "", output / "helm", [])


@render_app.command("systemd")
@handle_errors
def render_systemd_cmd(
    ctx: typer.Context,
    profile: str = typer.Argument(..., help="Profile to render (see `molctl profiles`)."),
    model_root: Optional[Path] = MODEL_ROOT_OPT,
    set_: List[str] = SET_OPT,
    api_key_file: Optional[Path] = typer.Option(
        None, "--api-key-file", envvar="MOLCTL_API_KEY_FILE", help="The key file the proxy unit reads (not read now)."
    ),
    allow_unauthenticated: bool = UNAUTH_OPT,
    store: Optional[str] = RENDER_STORE_OPT,
    proxy_arg: List[str] = RENDER_PROXY_ARG_OPT,
    user: Optional[str] = typer.Option(None, "--user", help="User= of both units (default: root, systemd's default)."),
    drain_timeout: float = DRAIN_OPT,
    stop_timeout: float = STOP_OPT,
    output: Optional[Path] = RENDER_OUTPUT_OPT,
) -> None:
    """An engine unit and a proxy unit running the argv `up` would run on this host."""
    from molctl.render import RenderOptions
    from molctl.render.systemd import render_systemd, systemd_stream

    opts = RenderOptions(
        overrides=overrides_from(model_root, set_),
        drain_timeout_s=drain_timeout,
        stop_timeout_s=stop_timeout,
        store=store,
        allow_unauthenticated=allow_unauthenticated,
        proxy_args=list(proxy_arg),
        api_key_file=api_key_file,
        state_dir=ctx.obj.state_dir,
        user=user,
    )
    warnings: list[str] = []
    units = render_systemd(profile, ctx.obj.dirs(), opts, warnings)
    _render_out(units, systemd_stream(units), output, warnings)
