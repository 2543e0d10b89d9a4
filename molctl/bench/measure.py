"""The measuring side of `molctl bench`: one streamed request timed (`_one`), the engine's and
the proxy's /metrics (`parse_metrics`, `_engine_delta`), the VRAM sampler, one cell (a series at
one concurrency, `_run_cell`) and its summary (`_cell_summary`), the adapter efficacy canary's
cell, and every cell of a run in order (`_run`)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx

from molctl import localhttp
from molctl.bench import PROXY_METRICS, BenchOptions, Req, Target, workload
from molctl.routes import ROUTES


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    v = sorted(values)

    def pct(q: float) -> float:  # nearest rank
        return round(v[max(0, min(len(v) - 1, int(-(-q * len(v) // 100)) - 1))], 6)

    return {"p50": pct(50), "p95": pct(95), "p99": pct(99)}


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
                    chunks += _take_chunk(out, chunk, t0)
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


def _take_chunk(out: dict[str, Any], chunk: Any, t0: float) -> int:
    """One stream frame folded into `out` (usage, TTFT, error kind); returns its content deltas."""
    chunks = 0
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
    return chunks


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
    async with localhttp.async_client(timeout=httpx.Timeout(opts.request_timeout_s), limits=limits) as client:
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
    """The `canary` series: molctl.lifecycle.canary once, its requests (base, L0-L3, one at a time) as the
    cell's samples, an adapter with no effect counted as the error `no_effect`, the whole result
    under `canary`."""
    from molctl.engines import get_engine
    from molctl.lifecycle import canary

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


async def _scrape(client: httpx.AsyncClient, url: str, headers: dict | None = None) -> dict[str, float] | None:
    try:
        r = await client.get(url, headers=headers or {}, timeout=5.0)
    except httpx.HTTPError:
        return None
    return parse_metrics(r.text) if r.status_code == 200 else None
