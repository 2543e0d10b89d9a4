"""`molctl bench PROFILE`: measure the running stack the way seed 002 asks (the core; the CLI is
a thin command in `molctl.cli`, rendering in `molctl.output`).

One run measures, in this order and against the same seeded workload: the engine's base model
directly (`base`, the reference), each adapter directly (`L0`..`L3`), a fixed 25/25/25/25 mix of
the adapters (`mix`, seeded order, per-adapter figures kept apart so an average never hides the
slow adapter) and the public model through the MoL proxy (`proxy`: route hop + answer; the
summaries it triggers are counted separately from the proxy's own metrics). Every request is a
streamed chat completion (temperature 0, a fixed `max_tokens`) timed for its first token (TTFT)
and its end. Per series and concurrency: p50/p95/p99 of both, output tokens/s, requests/s over
the cell's wall time, errors by kind (`http_<status>`, `timeout`, `connection`, `stream_error`),
the engine's /metrics deltas and the peak VRAM per GPU (NVML, sampled at a fixed interval
before, during and after the run; skipped with a note where there is none).

A run directory (`STATE/PROFILE/bench/RUN_ID/`) keeps `summary.json`, `samples.jsonl` (one line
per request), `vram.jsonl` and, when `molctl lock` wrote one, a copy of the newest manifest
(`manifest.json`, its SHA-256 in the summary)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from molctl.errors import ExitStatus, MolctlError, UsageError
from molctl.profiles import ROUTES

# `canary`: the adapter efficacy canary of `up` (molctl.canary), once per run (not per concurrency):
# an engine whose adapter stopped having an effect shows in the bench report too
SERIES = ("base", "L0", "L1", "L2", "L3", "mix", "proxy", "canary")
FORMAT = 1
# prompt lengths of the request pool (words; a word of the fixed vocabulary is about one token)
PROMPT_WORDS = (16, 64, 256)
POOL_SIZE = 64
VOCAB = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu river stone cloud ember maple "
    "orbit pixel quartz saddle timber violet willow harbor lantern meadow"
).split()
PROXY_METRICS = (
    "requests_total",
    "route_hops_total",
    "route_fallbacks_total",
    "route_timeouts_total",
    "summaries_total",
    "summary_failures_total",
    "summaries_dropped_total",
    "engine_errors_total",
)


class NothingRunning(MolctlError):
    """No live stack of the profile to measure (exit 3, like a failed precondition)."""

    exit_status = ExitStatus.CHECK_FAILED


@dataclass
class BenchOptions:
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 8])
    requests: int | None = None  # per series and concurrency; None with no duration: DEFAULT_DURATION_S
    duration_s: float | None = None
    seed: int = 0
    max_tokens: int = 32
    series: list[str] = field(default_factory=lambda: list(SERIES))
    api_key: str | None = None
    request_timeout_s: float = 60.0
    vram_interval_s: float = 1.0
    output: Path | None = None  # the run directory (default STATE/PROFILE/bench/RUN_ID)


DEFAULT_DURATION_S = 2.5  # 7 series x 3 concurrency levels x 2.5 s: about a minute


@dataclass
class Target:
    """The running stack, as its records say: where the engine and proxy listen and the names to ask for."""

    profile: str
    engine_kind: str
    engine_url: str
    proxy_url: str | None
    base_model: str  # engine.served_name
    adapter_models: dict[str, str]  # L0 -> the engine's model field for it
    public_model: str
    metrics_url: str | None = None  # the proxy's metrics listener (proxy.metrics_port), if any
    spec: Any = None  # the running stack's Profile (the canary's requests)


@dataclass
class Req:
    i: int
    prompt_id: int
    words: int
    text: str
    adapter: str  # the mix's adapter for this request (used by the mix series only)


# ------------------------------------------------------------------------------- the stack


def find_target(ctx, name: str) -> Target:
    """The running stack of PROFILE from its records (exit 3 when nothing of it runs)."""
    from molctl import stackconfig
    from molctl.engines import get_engine
    from molctl.errors import ProfileError
    from molctl.profiles import load_profile
    from molctl.stacks import component_url, known_or_recorded, recorded_config
    from molctl.state import check_own_state_dir, is_same_process, read_records_checked
    from molctl.status import metrics_url

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
    profile = stackconfig.profile_from(recorded_config(records))
    if profile is None:
        try:
            profile = load_profile(name, ctx.dirs())
        except ProfileError as exc:
            raise NothingRunning(f"{name}: the running stack's profile cannot be read: {exc}") from None
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


# ------------------------------------------------------------------------------- workload


def workload(seed: int, size: int = POOL_SIZE) -> list[Req]:
    """The fixed request pool: seeded prompts of fixed lengths, and the mix's adapter per request
    (25/25/25/25: each block of 4 consecutive requests holds L0-L3 once, in a seeded order)."""
    rng = random.Random(seed)
    mix: list[str] = []
    while len(mix) < size:  # every 4 consecutive requests hold each adapter once, in a seeded order
        block = list(ROUTES)
        rng.shuffle(block)
        mix += block
    pool = []
    for k in range(size):
        words = PROMPT_WORDS[k % len(PROMPT_WORDS)]
        body = " ".join(rng.choice(VOCAB) for _ in range(words))
        pool.append(Req(k, k, words, f"[bench {seed}:{k}] Continue this list: {body}", mix[k]))
    return pool


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    v = sorted(values)

    def pct(q: float) -> float:  # nearest rank
        return round(v[max(0, min(len(v) - 1, int(-(-q * len(v) // 100)) - 1))], 6)

    return {"p50": pct(50), "p95": pct(95), "p99": pct(99)}


# ------------------------------------------------------------------------------- one request


async def _one(client: httpx.AsyncClient, url: str, headers: dict, body: dict, timeout: float) -> dict:
    """Stream one chat completion: TTFT (first content/reasoning/tool delta), total, tokens, error kind."""
    t0 = time.perf_counter()
    out: dict[str, Any] = {
        "ok": False,
        "status": None,
        "error": None,
        "ttft_s": None,
        "total_s": None,
        "output_tokens": None,
        "prompt_tokens": None,
    }
    chunks = 0
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                out["status"] = resp.status_code
                if resp.status_code != 200:
                    await resp.aread()
                    out["error"] = f"http_{resp.status_code}"
                    return out
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        continue
                    try:
                        if "error" in chunk:
                            out["error"] = "stream_error"
                        if chunk.get("usage"):
                            out["output_tokens"] = chunk["usage"].get("completion_tokens")
                            out["prompt_tokens"] = chunk["usage"].get("prompt_tokens")
                        for choice in chunk.get("choices") or []:
                            delta = choice.get("delta") or {}
                            if (
                                delta.get("content")
                                or delta.get("reasoning_content")
                                or delta.get("reasoning")
                                or delta.get("tool_calls")
                            ):
                                chunks += 1
                                if out["ttft_s"] is None:
                                    out["ttft_s"] = round(time.perf_counter() - t0, 6)
                            if choice.get("finish_reason") in ("abort", "error"):
                                out["error"] = f"finish_{choice['finish_reason']}"
                    except (AttributeError, TypeError):  # a frame of another shape: the engine's fault, counted
                        out["error"] = "stream_error"
    except (TimeoutError, httpx.TimeoutException):
        out["error"] = "timeout"
        return out
    except (httpx.TransportError, httpx.StreamError, OSError):
        out["error"] = "connection"
        return out
    out["total_s"] = round(time.perf_counter() - t0, 6)
    for key in ("output_tokens", "prompt_tokens"):  # an engine's usage of another type must not break the sums
        if not isinstance(out[key], int) or isinstance(out[key], bool):
            out[key] = None
    if out["output_tokens"] is None:
        out["output_tokens"] = chunks
    out["ok"] = out["error"] is None
    return out


# ------------------------------------------------------------------------------- metrics


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: the sum over label sets per metric name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


async def _scrape(client: httpx.AsyncClient, url: str, headers: dict | None = None) -> dict[str, float] | None:
    try:
        r = await client.get(url, headers=headers or {}, timeout=5.0)
    except httpx.HTTPError:
        return None
    return parse_metrics(r.text) if r.status_code == 200 else None


def _engine_delta(kind: str, before: dict | None, after: dict | None) -> dict[str, Any]:
    from molctl.engines import get_engine

    names = get_engine(kind).bench_metrics  # the engine /metrics counters whose deltas are reported
    if before is None or after is None:
        return {
            "available": False,
            "note": "the engine's /metrics did not answer",
            "deltas": {},
            "missing": sorted(names),
        }
    deltas, missing = {}, []
    for key, metric in names.items():
        # a labelled counter has no sample before its first increment (prometheus_client), e.g.
        # SGLang's sglang:cached_tokens_total until a request hits the cache (metrics/collector.py):
        # one that appears during the run started at 0
        if metric in after:
            deltas[key] = round(after[metric] - before.get(metric, 0.0), 6)
        else:
            missing.append(key)
    return {"available": True, "deltas": deltas, "missing": missing}


# ------------------------------------------------------------------------------- VRAM


class VramSampler:
    """Samples used memory per GPU every `interval` seconds in a thread, each sample tagged with
    the phase (before / SERIES@C / after). No NVML: `available` False and a note."""

    def __init__(self, probe, interval: float):
        self.probe = probe
        self.interval = interval
        self.samples: list[dict] = []
        self.phase = "before"
        self.note: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> bool:
        from molctl.probes import GpuUnavailable

        try:
            inv = self.probe.inventory()
        except GpuUnavailable as exc:
            self.note = f"VRAM not sampled: {exc}"
            return False
        except Exception as exc:  # noqa: BLE001 - a probe failure must not end the run
            self.note = f"VRAM not sampled: {exc}"
            return False
        self.samples.append(
            {
                "t": round(time.time(), 3),
                "phase": self.phase,
                "gpus": [
                    {"index": d.index, "used_bytes": d.total_bytes - d.free_bytes, "total_bytes": d.total_bytes}
                    for d in inv.devices
                ],
            }
        )
        return True

    def start(self) -> None:
        if not self.sample():
            return

        def loop():
            while not self._stop.wait(self.interval):
                if not self.sample():
                    return

        self._thread = threading.Thread(target=loop, name="molctl-bench-vram", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.note is None:
            self.phase = "after"
            self.sample()

    @property
    def available(self) -> bool:
        return bool(self.samples)

    def peak(self, phase: str | None = None) -> list[dict] | None:
        if not self.available:
            return None
        peaks: dict[int, int] = {}
        for s in self.samples:
            if phase is None or s["phase"] == phase:
                for g in s["gpus"]:
                    peaks[g["index"]] = max(peaks.get(g["index"], 0), g["used_bytes"])
        return [{"index": i, "used_bytes": b} for i, b in sorted(peaks.items())]


# ------------------------------------------------------------------------------- a run


def _cell_summary(samples: list[dict], wall: float) -> dict[str, Any]:
    ok = [s for s in samples if s["ok"]]
    errors: dict[str, int] = {}
    for s in samples:
        if not s["ok"]:
            errors[s["error"]] = errors.get(s["error"], 0) + 1
    tokens = sum(s["output_tokens"] or 0 for s in ok)
    return {
        "requests": len(samples),
        "ok": len(ok),
        "errors": errors,
        "ttft_s": _percentiles([s["ttft_s"] for s in ok if s["ttft_s"] is not None]),
        "total_s": _percentiles([s["total_s"] for s in ok]),
        "output_tokens": tokens,
        "wall_s": round(wall, 6),
        "output_tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else None,
    }


def _by_adapter(samples: list[dict]) -> dict[str, Any]:
    out = {}
    for route in ROUTES:
        mine = [s for s in samples if s["adapter"] == route]
        ok = [s for s in mine if s["ok"]]
        errors: dict[str, int] = {}
        for s in mine:
            if not s["ok"]:
                errors[s["error"]] = errors.get(s["error"], 0) + 1
        t, f = (
            _percentiles([s["total_s"] for s in ok]),
            _percentiles([s["ttft_s"] for s in ok if s["ttft_s"] is not None]),
        )
        out[route] = {
            "requests": len(mine),
            "ok": len(ok),
            "errors": errors,
            "ttft_s": {"p50": f["p50"], "p95": f["p95"]},
            "total_s": {"p50": t["p50"], "p95": t["p95"]},
        }
    return out


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


async def _run_cell(
    target: Target,
    series: str,
    conc: int,
    pool: list[Req],
    opts: BenchOptions,
    client: httpx.AsyncClient,
    key_headers: dict,
) -> tuple[list[dict], float]:
    if series == "proxy":
        url, headers = target.proxy_url + "/v1/chat/completions", key_headers
    else:
        url, headers = target.engine_url + "/v1/chat/completions", {}
    counter = iter(range(10**9))
    samples: list[dict] = []
    deadline = None if opts.duration_s is None else time.perf_counter() + opts.duration_s
    t_start = time.perf_counter()

    def next_index() -> int | None:
        k = next(counter)
        if deadline is not None:
            return k if time.perf_counter() < deadline else None
        return k if k < (opts.requests or 0) else None

    async def worker():
        while (k := next_index()) is not None:
            req = pool[k % len(pool)]
            if series == "proxy":
                model, adapter = target.public_model, None
            elif series == "mix":
                model, adapter = target.adapter_models[req.adapter], req.adapter
            elif series == "base":
                model, adapter = target.base_model, None
            else:
                model, adapter = target.adapter_models[series], series
            body = {
                "model": model,
                "messages": [{"role": "user", "content": req.text}],
                "temperature": 0,
                "max_tokens": opts.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            started = time.perf_counter() - t_start
            result = await _one(client, url, headers, body, opts.request_timeout_s)
            samples.append(
                {
                    "series": series,
                    "concurrency": conc,
                    "i": k,
                    "prompt_id": req.prompt_id,
                    "prompt_words": req.words,
                    "adapter": adapter,
                    "start_s": round(started, 6),
                    **result,
                }
            )

    await asyncio.gather(*(worker() for _ in range(conc)))
    return sorted(samples, key=lambda s: s["i"]), time.perf_counter() - t_start


async def _run(target: Target, opts: BenchOptions, vram: VramSampler, samples_out, progress, cells: list[dict]) -> None:
    """Measure every series x concurrency cell in order, appending each finished cell to `cells`
    (and its samples to `samples_out`): a Ctrl-C keeps the cells finished before it."""
    pool = workload(opts.seed)
    key_headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    limits = httpx.Limits(
        max_connections=max(opts.concurrency) + 4, max_keepalive_connections=max(opts.concurrency) + 4
    )
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(opts.request_timeout_s), limits=limits, trust_env=False
    ) as client:
        for series in opts.series:
            if series == "canary":
                if progress is not None:
                    progress("adapter efficacy canary")
                before = await _scrape(client, target.engine_url + "/metrics")
                cell = await _canary_cell(target, vram, samples_out)
                cell["engine_metrics"] = _engine_delta(
                    target.engine_kind, before, await _scrape(client, target.engine_url + "/metrics")
                )
                cells.append(cell)
                continue
            for conc in opts.concurrency:
                if progress is not None:
                    progress(f"{series} at concurrency {conc}")
                vram.phase = f"{series}@{conc}"
                before = await _scrape(client, target.engine_url + "/metrics")
                pbefore = (
                    await _scrape(client, target.metrics_url) if series == "proxy" and target.metrics_url else None
                )
                samples, wall = await _run_cell(target, series, conc, pool, opts, client, key_headers)
                after = await _scrape(client, target.engine_url + "/metrics")
                for s in samples:
                    samples_out.write(json.dumps(s) + "\n")
                cell = {
                    "series": series,
                    "concurrency": conc,
                    **_cell_summary(samples, wall),
                    "engine_metrics": _engine_delta(target.engine_kind, before, after),
                    "vram_peak": vram.peak(vram.phase),
                }
                if series == "mix":
                    cell["by_adapter"] = _by_adapter(samples)
                if series == "proxy":
                    pafter = await _scrape(client, target.metrics_url) if target.metrics_url else None
                    cell["proxy_metrics"] = (
                        {
                            k: round(pafter.get(f"molctl_proxy_{k}", 0) - pbefore.get(f"molctl_proxy_{k}", 0), 6)
                            for k in PROXY_METRICS
                        }
                        if pbefore is not None and pafter is not None
                        else None
                    )
                cells.append(cell)
                samples_out.flush()


async def _canary_cell(target: Target, vram: VramSampler, samples_out) -> dict[str, Any]:
    """The `canary` series: molctl.canary once, its requests (base, L0-L3, one at a time) as the
    cell's samples, an adapter with no effect counted as the error `no_effect`, the whole result
    under `canary`."""
    from molctl import canary
    from molctl.engines import get_engine

    vram.phase = "canary@1"
    t0 = time.perf_counter()
    result = await asyncio.to_thread(canary.run, target.spec, get_engine(target.engine_kind), target.engine_url)
    wall = time.perf_counter() - t0
    samples = []
    asked = [("base", result.get("base"))] + list((result.get("adapters") or {}).items())
    for i, (who, got) in enumerate(asked):
        ok = got is not None
        samples.append(
            {
                "series": "canary",
                "concurrency": 1,
                "i": i,
                "prompt_id": None,
                "prompt_words": None,
                "adapter": None if who == "base" else who,
                "start_s": None,
                "ok": ok,
                "status": 200 if ok else None,
                "error": None if ok else "canary_error",
                "ttft_s": None,
                "total_s": got["seconds"] if ok else None,
                "output_tokens": len(got["tokens"]) if ok else None,
                "prompt_tokens": None,
            }
        )
    failed = 1 + len(canary.ROUTES) - len(samples)
    for s in samples:
        samples_out.write(json.dumps(s) + "\n")
    cell = {
        "series": "canary",
        "concurrency": 1,
        **_cell_summary(samples, wall),
        "engine_metrics": None,
        "vram_peak": vram.peak(vram.phase),
        "canary": canary.brief(result),
    }
    cell["requests"] += failed
    if failed:
        cell["errors"]["canary_error"] = cell["errors"].get("canary_error", 0) + failed
    if result["no_effect"]:
        cell["errors"]["no_effect"] = len(result["no_effect"])
    return cell


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
        r = httpx.get(target.proxy_url + "/v1/models", headers=headers, timeout=5.0, trust_env=False)
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
        from molctl.manifest import newest
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
    if opts.output is not None:
        run_dir = Path(opts.output)
        run_id = run_dir.name
        _check_output(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise UsageError(f"--output {run_dir} cannot be created: {exc.strerror or exc}") from None
    else:
        run_id, run_dir = new_run_dir(ctx.state_dir, name)
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
    base = {c["concurrency"]: c for c in cells if c["series"] == "base"}
    for c in cells:
        ref = base.get(c["concurrency"])
        c["vs_base"] = (
            None
            if ref is None
            else {
                "ttft_p50": _ratio(c["ttft_s"]["p50"], ref["ttft_s"]["p50"]),
                "total_p50": _ratio(c["total_s"]["p50"], ref["total_s"]["p50"]),
                "total_p95": _ratio(c["total_s"]["p95"], ref["total_s"]["p95"]),
                "requests_per_s": _ratio(c["requests_per_s"], ref["requests_per_s"]),
            }
        )
    with open(run_dir / "vram.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(s) + "\n" for s in vram.samples)
    summary = {
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


# ------------------------------------------------------------------------------- compare


def load_run(state_dir: Path, profile: str | None, ref: str) -> dict:
    """A run's summary.json by directory, or by run id under STATE/PROFILE/bench (any profile when None)."""
    if profile is not None:
        from molctl.profiles import check_profile_name

        check_profile_name(profile)
    path = Path(ref).expanduser()
    candidates = [path] if path.is_dir() else []
    if not candidates:
        roots = [Path(state_dir) / profile / "bench"] if profile else sorted(Path(state_dir).glob("*/bench"))
        candidates = [r / ref for r in roots if (r / ref).is_dir()]
    if not candidates:
        raise UsageError(f"no bench run {ref!r} (a run id under STATE/PROFILE/bench/ or a run directory)")
    if len(candidates) > 1:  # two profiles benched in the same second: never pick one silently
        raise UsageError(
            f"bench run {ref!r} is in more than one profile "
            f"({', '.join(c.parent.parent.name for c in candidates)}): give PROFILE "
            f"(molctl bench PROFILE --compare ...) or the run directory"
        )
    summary = candidates[0] / "summary.json"
    try:
        if summary.exists() and not summary.is_file():  # a FIFO would block the read forever
            raise UsageError(f"{summary} is not a regular file")
        data = json.loads(summary.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"bench run {candidates[0]} has no summary.json (an interrupted or failed run)") from None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise UsageError(f"{summary} cannot be read: {why}") from None
    problem = _summary_problem(data)
    if problem:
        raise UsageError(f"{summary} is not a molctl bench summary: {problem}")
    return data


def _summary_problem(data: Any) -> str | None:
    """The first thing `compare` needs that a (hand-edited, damaged) summary lacks, or None."""

    def number(v) -> bool:
        return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))

    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        return "no 'results' list"
    for i, c in enumerate(data["results"]):
        where = f"results[{i}]"
        if not isinstance(c, dict):
            return f"{where} is not an object"
        if not isinstance(c.get("series"), str) or not isinstance(c.get("concurrency"), int):
            return f"{where} lacks a string 'series' or an integer 'concurrency'"
        for key in ("ttft_s", "total_s"):
            if not isinstance(c.get(key), dict) or not all(number(c[key].get(p)) for p in ("p50", "p95")):
                return f"{where}.{key} is not an object of numbers p50, p95"
        for key in ("requests_per_s", "output_tokens_per_s"):
            if not number(c.get(key)):
                return f"{where}.{key} is not a number"
        if not isinstance(c.get("errors"), dict) or not all(isinstance(n, int) for n in c["errors"].values()):
            return f"{where}.errors is not an object of counts"
    return None


def compare(a: dict, b: dict) -> dict[str, Any]:
    """Per series and concurrency present in either run: A, B and B/A of the main figures."""
    keys = ("ttft_p50", "ttft_p95", "total_p50", "total_p95", "requests_per_s", "output_tokens_per_s", "errors")

    def figures(c: dict | None) -> dict | None:
        if c is None:
            return None
        return {
            "ttft_p50": c["ttft_s"]["p50"],
            "ttft_p95": c["ttft_s"]["p95"],
            "total_p50": c["total_s"]["p50"],
            "total_p95": c["total_s"]["p95"],
            "requests_per_s": c["requests_per_s"],
            "output_tokens_per_s": c["output_tokens_per_s"],
            "errors": sum(c["errors"].values()),
        }

    index_a = {(c["series"], c["concurrency"]): c for c in a["results"]}
    index_b = {(c["series"], c["concurrency"]): c for c in b["results"]}
    order = list(dict.fromkeys([*index_a, *index_b]))
    rows = []
    for key in order:
        fa, fb = figures(index_a.get(key)), figures(index_b.get(key))
        rows.append(
            {
                "series": key[0],
                "concurrency": key[1],
                "a": fa,
                "b": fb,
                "ratio": {k: _ratio(fb[k], fa[k]) for k in keys if k != "errors"} if fa and fb else None,
            }
        )
    return {
        "a": {"run_id": a.get("run_id"), "run_dir": a.get("run_dir"), "profile": a.get("profile")},
        "b": {"run_id": b.get("run_id"), "run_dir": b.get("run_dir"), "profile": b.get("profile")},
        "rows": rows,
    }


MAX_CONCURRENCY = 1024  # one coroutine and one connection each: far past what one host's file descriptors serve


def parse_concurrency(text: str) -> list[int]:
    """`1,4,8`: integers from 1 to MAX_CONCURRENCY; an empty item (`1,,2`, a trailing comma) is
    a typo, refused like any other."""
    parts = [x.strip() for x in text.split(",")]
    try:
        values = [int(x) for x in parts]
    except ValueError:
        raise UsageError(f"--concurrency {text!r}: expected integers like 1,4,8") from None
    if not values or any(v < 1 or v > MAX_CONCURRENCY for v in values):
        raise UsageError(f"--concurrency {text!r}: expected integers from 1 to {MAX_CONCURRENCY} like 1,4,8")
    return list(dict.fromkeys(values))


def parse_series(text: str) -> list[str]:
    """`base,L0,mix`: names of SERIES (case matters), no empty item (as `--concurrency`); the
    error names the first bad item."""
    values = [x.strip() for x in text.split(",")]
    bad = next((v for v in values if v not in SERIES), None)
    if bad is not None:
        why = "an empty item" if bad == "" else f"unknown {bad!r}"
        raise UsageError(f"--series {text!r}: {why}; expected a comma list of {','.join(SERIES)}")
    return [s for s in SERIES if s in values]  # base first, as the verification method asks


def api_key_from(path: Path | None) -> str | None:
    """The proxy key bench sends: the first of the key file, else MOLCTL_API_KEY, else None."""
    from molctl.keys import resolve_api_keys

    keys = resolve_api_keys(path, allow_unauthenticated=True)
    return keys[0] if keys else None


__all__ = [
    "SERIES",
    "BenchOptions",
    "NothingRunning",
    "bench",
    "compare",
    "load_run",
    "parse_concurrency",
    "parse_series",
    "api_key_from",
    "workload",
    "parse_metrics",
]
