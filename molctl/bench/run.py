"""`molctl bench PROFILE` end to end (`bench`): the running stack as its records say
(`find_target`), a run directory (`new_run_dir`), the measured cells (molctl.bench.measure), the
ratios to base-only and the files the run keeps."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import httpx

from molctl import localhttp
from molctl.bench import (
    DEFAULT_DURATION_S,
    FORMAT,
    POOL_SIZE,
    PROMPT_WORDS,
    BenchOptions,
    NothingRunning,
    Target,
    ratio,
    running_profile,
)
from molctl.bench.measure import VramSampler, _run
from molctl.errors import ExitStatus, MolctlError, UsageError
from molctl.routes import ROUTES


def find_target(ctx, name: str) -> Target:
    """The running stack of PROFILE from its records (exit 3 when nothing of it runs)."""
    from molctl.engines import get_engine
    from molctl.lifecycle.stacks import component_url, known_or_recorded
    from molctl.lifecycle.status import metrics_url
    from molctl.state import check_own_state_dir, is_same_process, read_records_checked

    known_or_recorded(ctx, name)
    check_own_state_dir(ctx.state_dir)  # another user's record could name the host the key is sent to
    records, problems = read_records_checked(ctx.state_dir, name)
    engine = records.get("engine")
    bad = next((p for p in problems if p.component == "engine"), None)
    if engine is None and bad is not None:  # the stack may well run: say so, never "nothing is running"
        raise NothingRunning(
            f"the engine record of {name} cannot be read: {bad.path}: {bad.error} "
            f"(molctl status {name} shows what runs; molctl down {name} --force clears it)"
        )
    if engine is None or not is_same_process(engine):
        raise NothingRunning(f"nothing is running for {name}: no live engine recorded (molctl up {name} starts it)")
    profile = running_profile(ctx, name, records)
    kind = get_engine(profile.engine.kind)
    proxy = records.get("proxy")
    proxy_url = component_url(proxy) if proxy is not None and is_same_process(proxy) else None
    return Target(
        profile=name,
        engine_kind=profile.engine.kind,
        engine_url=component_url(engine),
        proxy_url=proxy_url,
        base_model=profile.engine.served_name,
        adapter_models={r: kind.adapter_model(profile, r) for r in ROUTES},
        public_model=profile.served_model_name,
        metrics_url=metrics_url(profile) if proxy_url and profile.proxy.metrics_port else None,
        spec=profile,
    )


def _check_proxy(target: Target, opts: BenchOptions) -> None:
    if "proxy" not in opts.series:
        return
    if target.proxy_url is None:
        raise NothingRunning(
            f"the proxy of {target.profile} is not running; bench the engine only with "
            f"--series {','.join(s for s in opts.series if s != 'proxy') or 'base'}"
        )
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    try:
        r = localhttp.get(target.proxy_url + "/v1/models", headers=headers, timeout=5.0)
    except httpx.HTTPError as exc:
        raise NothingRunning(f"the proxy of {target.profile} does not answer at {target.proxy_url}: {exc}") from None
    if r.status_code == 401:
        raise UsageError(
            "the proxy series needs the proxy's API key: --api-key-file F or MOLCTL_API_KEY "
            "(or leave proxy out of --series)"
            if not opts.api_key
            else "the proxy refused the API key given (401)"
        )


def new_run_dir(state_dir: Path, profile: str, now: float | None = None) -> tuple[str, Path]:
    """A new run directory, created here (mkdir is the claim: two benches started in the same
    second get `RUN_ID` and `RUN_ID-2`, never the same folder)."""
    base = Path(state_dir) / profile / "bench"
    base.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now if now is not None else time.time()))
    run_id, n = stamp, 1
    while True:
        try:
            (base / run_id).mkdir(mode=0o700)
            return run_id, base / run_id
        except FileExistsError:
            n += 1
            run_id = f"{stamp}-{n}"


def _manifest(state_dir: Path, profile: str, run_dir: Path) -> dict | None:
    try:
        from molctl.manifestfile import newest
    except ImportError:
        return None
    path = newest(state_dir, profile)
    if path is None:
        return None
    try:
        data = path.read_bytes()
        (run_dir / "manifest.json").write_bytes(data)
    except OSError:
        return None
    return {"path": str(path), "sha256": hashlib.sha256(data).hexdigest(), "copy": "manifest.json"}


def _check_output(run_dir: Path) -> None:
    """--output is a new or empty directory: an earlier run's files (its manifest.json, samples)
    must never end up mixed with this run's."""
    if run_dir.exists() or run_dir.is_symlink():
        if not run_dir.is_dir():
            raise UsageError(f"--output {run_dir} exists and is not a directory")
        try:
            taken = next(run_dir.iterdir(), None) is not None
        except OSError as exc:
            raise UsageError(f"--output {run_dir}: {exc.strerror}") from None
        if taken:
            raise UsageError(f"--output {run_dir} is not empty (an earlier run?): give a new or empty directory")


def bench(ctx, name: str, opts: BenchOptions, gpu_probe=None, progress=None) -> dict[str, Any]:
    """Run the benchmark against PROFILE's running stack; returns the summary (also written to the run dir)."""
    from molctl.probes import NvmlProbe

    if opts.requests is None and opts.duration_s is None:
        opts.duration_s = DEFAULT_DURATION_S
    target = find_target(ctx, name)
    _check_proxy(target, opts)
    run_id, run_dir = _open_run_dir(ctx, name, opts)
    vram = VramSampler(gpu_probe or NvmlProbe(), opts.vram_interval_s)
    started = time.time()
    cells: list[dict] = []
    interrupted = False
    vram.start()
    try:
        with open(run_dir / "samples.jsonl", "w", encoding="utf-8") as samples_out:
            asyncio.run(_run(target, opts, vram, samples_out, progress, cells))
    except KeyboardInterrupt:  # an hour-long run stopped by hand keeps what it measured
        interrupted = True
    finally:
        vram.stop()
    _add_vs_base(cells)
    with open(run_dir / "vram.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(s) + "\n" for s in vram.samples)
    summary = _summary(ctx, name, opts, target, vram, run_id, run_dir, started, cells, interrupted)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    if interrupted:
        once = int("canary" in opts.series)
        total = (len(opts.series) - once) * len(opts.concurrency) + once
        raise MolctlError(
            f"interrupted: {len(cells)} of {total} cells finished; their results are in "
            f'{run_dir / "summary.json"} ("interrupted": true)',
            ExitStatus.INTERRUPTED,
        )
    return summary


def _open_run_dir(ctx, name: str, opts: BenchOptions) -> tuple[str, Path]:
    """(run id, run directory): --output (checked, created), else a new one under the state dir."""
    if opts.output is not None:
        run_dir = Path(opts.output)
        run_id = run_dir.name
        _check_output(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise UsageError(f"--output {run_dir} cannot be created: {exc.strerror or exc}") from None
        return run_id, run_dir
    return new_run_dir(ctx.state_dir, name)


def _add_vs_base(cells: list[dict]) -> None:
    """Each cell's ratios to the base-only cell of the same concurrency (None without one)."""
    base = {c["concurrency"]: c for c in cells if c["series"] == "base"}
    for c in cells:
        ref = base.get(c["concurrency"])
        c["vs_base"] = (
            None
            if ref is None
            else {
                "ttft_p50": ratio(c["ttft_s"]["p50"], ref["ttft_s"]["p50"]),
                "total_p50": ratio(c["total_s"]["p50"], ref["total_s"]["p50"]),
                "total_p95": ratio(c["total_s"]["p95"], ref["total_s"]["p95"]),
                "requests_per_s": ratio(c["requests_per_s"], ref["requests_per_s"]),
            }
        )


def _summary(
    ctx,
    name: str,
    opts: BenchOptions,
    target: Target,
    vram: VramSampler,
    run_id: str,
    run_dir: Path,
    started: float,
    cells: list[dict],
    interrupted: bool,
) -> dict[str, Any]:
    """The run's summary.json (its shape: docs/contract.md)."""
    return {
        "format": FORMAT,
        "run_id": run_id,
        "run_dir": str(run_dir),
        "profile": name,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 3),
        "engine": {"kind": target.engine_kind, "url": target.engine_url, "base_model": target.base_model},
        "proxy": {"url": target.proxy_url, "model": target.public_model} if "proxy" in opts.series else None,
        "workload": {
            "seed": opts.seed,
            "pool": POOL_SIZE,
            "prompt_words": list(PROMPT_WORDS),
            "max_tokens": opts.max_tokens,
            "temperature": 0,
            "mix": "25/25/25/25 L0-L3, seeded order",
            "concurrency": opts.concurrency,
            "requests": opts.requests,
            "duration_s": opts.duration_s,
            "request_timeout_s": opts.request_timeout_s,
            "series": list(opts.series),
        },
        "vram": {
            "available": vram.available,
            "interval_s": opts.vram_interval_s,
            "note": vram.note,
            "before": vram.peak("before"),
            "peak": vram.peak(),
            "after": vram.peak("after"),
        },
        "manifest": _manifest(ctx.state_dir, name, run_dir),
        "notes": [
            "proxy: route + answer per request; the summaries it triggers run in the background on the "
            "engine and are counted in proxy_metrics.summaries_total (and in the engine's request counts)"
        ],
        "results": cells,
        "interrupted": interrupted,
    }
