"""`molctl proxy PROFILE --upstream URL` (the proxy in the foreground: `proxy_cmd`, registered by
molctl.cli) and `molctl state stats|prune` (the proxy's store, `state_app`)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from molctl.cli.base import JSON_OPT, SET_OPT, _not_negative, _positive, handle_errors, overrides_from


@handle_errors
def proxy_cmd(
    ctx: typer.Context,
    profile: str = typer.Argument(..., help="Profile whose served model, prompts and limits the proxy uses."),
    upstream: str = typer.Option(..., "--upstream", help="Engine base URL, e.g. http://127.0.0.1:8000."),
    host: str = typer.Option("127.0.0.1", "--host", help="Listen address (loopback unless told otherwise)."),
    port: Optional[int] = typer.Option(None, "--port", help="Listen port (default: the profile's proxy.port)."),
    api_key_file: Optional[Path] = typer.Option(
        None, "--api-key-file", envvar="MOLCTL_API_KEY_FILE", help="File with the accepted API keys, one per line."
    ),
    allow_unauthenticated: bool = typer.Option(False, "--allow-unauthenticated", help="Serve without an API key."),
    drain_timeout: float = typer.Option(
        600.0,
        "--drain-timeout",
        callback=_not_negative,
        help="On SIGTERM, seconds in-flight requests may take to finish (>= 0).",
    ),
    sse_keepalive: Optional[float] = typer.Option(
        None,
        "--sse-keepalive",
        callback=_positive,
        help="Seconds between SSE keep-alive comments while waiting (> 0; "
        "default: the profile's proxy.sse_keepalive_s, 10).",
    ),
    set_: List[str] = SET_OPT,
    set_json: Optional[str] = typer.Option(
        None,
        "--set-json",
        metavar="JSON",
        help="Overrides as typed data: a JSON list of [dotted.key, value] pairs "
        "(what `molctl up` passes; applied after --set).",
    ),
    log_max_bytes: Optional[int] = typer.Option(
        None, "--log-max-bytes", help="Rotate the log file stdout/stderr write to at this size."
    ),
    log_backups: int = typer.Option(2, "--log-backups", help="Rotated parts kept (.1, .2, ...)."),
    store: Optional[str] = typer.Option(
        None,
        "--store",
        metavar="SPEC",
        help="The Responses API's state store: sqlite (STATE/PROFILE/proxy-store.sqlite3), "
        "memory, sqlite:/abs/path.sqlite3, or redis[s]://host:port/db shared by "
        "replicas (default: the profile's proxy.store).",
    ),
    replica_id: Optional[str] = typer.Option(
        None, "--replica-id", help="With a redis:// store: this replica's id (default: hostname:port)."
    ),
    advertise_upstream: Optional[str] = typer.Option(
        None,
        "--advertise-upstream",
        metavar="URL",
        help="With a redis:// store: this replica's engine URL as its peers "
        "reach it (default: proxy.advertise_upstream, else --upstream).",
    ),
    metrics_port: Optional[int] = typer.Option(
        None,
        "--metrics-port",
        metavar="N",
        help="Serve Prometheus metrics on this port (on proxy.metrics_host; "
        "default: the profile's proxy.metrics_port, none when unset).",
    ),
) -> None:
    """Run the MoL proxy in the foreground: one public model, route -> answer -> summary over the adapters.

    The key may also come from the environment (MOLCTL_API_KEY, one key), never from argv."""
    import signal

    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the reload handler exists (see molctl/__main__.py)
    from molctl.proxy.http.server import run_proxy

    store_override = [("proxy.store", store)] if store is not None else []
    run_proxy(
        profile,
        ctx.obj,
        overrides_from(None, set_) + _typed_overrides(set_json) + store_override,
        upstream=upstream,
        host=host,
        port=port,
        api_key_file=api_key_file,
        allow_unauthenticated=allow_unauthenticated,
        drain_timeout=drain_timeout,
        sse_keepalive=sse_keepalive,
        log_max_bytes=log_max_bytes,
        log_backups=log_backups,
        replica_id=replica_id,
        advertise_upstream=advertise_upstream,
        metrics_port=metrics_port,
    )


def _typed_overrides(raw: Optional[str]) -> list[tuple[str, object]]:
    import json

    from molctl.errors import UsageError

    if not raw:
        return []
    try:
        pairs = json.loads(raw)
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in pairs
        ):
            raise ValueError("expected a list of [key, value] pairs")
    except ValueError as exc:
        raise UsageError(f"--set-json: {exc}") from None
    return [(k, v) for k, v in pairs]


state_app = typer.Typer(
    help="The proxy's durable state (the Responses API's stored responses) of a profile.", no_args_is_help=True
)


@state_app.command("stats")
@handle_errors
def state_stats_cmd(
    ctx: typer.Context,
    profile: str = typer.Argument(..., help="Profile whose store to describe (see `molctl profiles`)."),
    json_: bool = JSON_OPT,
) -> None:
    """The store's file, counts, bytes, oldest response, evicted/expired totals and bounds (never creates it)."""
    from molctl.output import Output
    from molctl.storeadmin import store_stats

    Output(as_json=json_).state_stats(store_stats(profile, ctx.obj))


@state_app.command("prune")
@handle_errors
def state_prune_cmd(
    ctx: typer.Context,
    profile: str = typer.Argument(..., help="Profile whose store to prune."),
    json_: bool = JSON_OPT,
) -> None:
    """Delete expired responses, then evict oldest first over the size caps (safe while the proxy runs)."""
    from molctl.output import Output
    from molctl.storeadmin import store_prune

    Output(as_json=json_).state_prune(store_prune(profile, ctx.obj))
