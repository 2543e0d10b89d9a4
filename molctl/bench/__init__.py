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
(`manifest.json`, its SHA-256 in the summary).

`molctl.bench.run` runs one (`bench`), `molctl.bench.measure` times requests and cells,
`molctl.bench.compare` compares two runs (`compare`, `load_run`); this module holds what they
share: the series, `BenchOptions`, `Target`, the seeded `workload` and the option parsers."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molctl.errors import ExitStatus, MolctlError, UsageError
from molctl.routes import ROUTES

# `canary`: the adapter efficacy canary of `up` (molctl.lifecycle.canary), once per run (not per concurrency):
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


def running_profile(ctx, name: str, records: dict) -> Any:
    """The Profile a running stack of `name` was started with (its records' configuration), else
    its profile file as it is now; neither readable: NothingRunning naming the profile."""
    from molctl import stackconfig
    from molctl.errors import ProfileError
    from molctl.lifecycle.stacks import recorded_config
    from molctl.profiles import load_profile

    profile = stackconfig.profile_from(recorded_config(records))
    if profile is not None:
        return profile
    try:
        return load_profile(name, ctx.dirs())
    except ProfileError as exc:
        raise NothingRunning(f"{name}: the running stack's profile cannot be read: {exc}") from None


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


def ratio(a, b) -> float | None:
    return round(a / b, 3) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None
