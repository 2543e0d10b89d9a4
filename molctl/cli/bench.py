"""`molctl bench`: measure the running stack, or compare two runs."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import typer

from molctl.cli.base import (
    JSON_OPT,
    _positive,
    handle_errors,
)


@handle_errors
def bench_cmd(
    ctx: typer.Context,
    profile: Optional[str] = typer.Argument(
        None, help="Profile whose running stack to measure (with --compare: where run ids are looked up)."
    ),
    concurrency: str = typer.Option("1,4,8", "--concurrency", help="Concurrency levels, comma-separated."),
    requests: Optional[int] = typer.Option(None, "--requests", min=1, help="Requests per series and concurrency."),
    duration: Optional[float] = typer.Option(
        None,
        "--duration",
        callback=_positive,
        help="Seconds per series and concurrency (default 2.5 when --requests is not given).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the prompt set and the mix's order."),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1, help="max_tokens of every request."),
    series: str = typer.Option(
        ",".join(("base", "L0", "L1", "L2", "L3", "mix", "proxy", "canary")),
        "--series",
        help="Series to run (base is always measured first): base,L0,L1,L2,L3,mix,proxy,canary "
        "(the adapter efficacy canary, once).",
    ),
    request_timeout: float = typer.Option(
        60.0, "--request-timeout", callback=_positive, help="Seconds one request may take."
    ),
    api_key_file: Optional[Path] = typer.Option(
        None,
        "--api-key-file",
        envvar="MOLCTL_API_KEY_FILE",
        help="The proxy's API key (first line) for the proxy series. Or set MOLCTL_API_KEY.",
    ),
    output: Optional[Path] = typer.Option(
        None, "--output", metavar="DIR", help="Run directory (default STATE/PROFILE/bench/RUN_ID)."
    ),
    compare: Optional[Tuple[str, str]] = typer.Option(
        None,
        "--compare",
        metavar="RUN_A RUN_B",
        help="Print the differences between two runs (run ids or run directories).",
    ),
    json_: bool = JSON_OPT,
) -> None:
    """Measure the running stack: base-only, each adapter, a 25/25/25/25 mix, and through the proxy (seed 002)."""
    from molctl import bench as b
    from molctl.bench.compare import compare as compare_runs
    from molctl.bench.compare import load_run
    from molctl.bench.run import bench
    from molctl.errors import UsageError
    from molctl.output import Output

    out = Output(as_json=json_)
    if compare and all(compare):
        out.bench(
            compare_runs(
                load_run(ctx.obj.state_dir, profile, compare[0]), load_run(ctx.obj.state_dir, profile, compare[1])
            )
        )
        return
    if profile is None:
        raise UsageError("bench needs PROFILE (or --compare RUN_A RUN_B)")
    if requests is not None and duration is not None:
        raise UsageError("--requests and --duration exclude each other")
    opts = b.BenchOptions(
        concurrency=b.parse_concurrency(concurrency),
        requests=requests,
        duration_s=duration,
        seed=seed,
        max_tokens=max_tokens,
        series=b.parse_series(series),
        api_key=b.api_key_from(api_key_file),
        request_timeout_s=request_timeout,
        output=output.expanduser().absolute() if output is not None else None,
    )
    out.bench(bench(ctx.obj, profile, opts, progress=None if json_ else lambda m: out.line(f"molctl: bench {m}")))
