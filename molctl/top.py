"""`molctl top`: a live terminal view of a running stack, from `molctl status` and the proxy's metrics.

Each frame is the stack's state (`status.status`: stopped|starting|ready|degraded|...), the
engine's load phase while it is not ready (its log, as `up` shows it: `Engine.phase`), and numbers
from the proxy's metrics listener (`proxy.metrics_port`): requests/s, p50/p95 per hop and of the
time to first token, the adapter mix, the prefix cache's hit ratio per adapter, the admission
queue, the summaries pending, and the speculative hop's hit ratio when the proxy exports one.

The numbers are computed from two scrapes, Prometheus-style (`numbers`): the counters' and the
histograms' growth between them, percentiles interpolated within the buckets as PromQL's
histogram_quantile does. Live, the older scrape is the one about WINDOW_S ago; with a single
scrape (`--once`, `--json`, the first frame) it is the proxy's start (`process_start_time_seconds`):
since-start figures.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from molctl.bench import NothingRunning, running_profile

WINDOW_S = 10.0  # live: rates and percentiles over about the last 10 s
REFRESH_S = 1.0
# One metrics scrape, at most: its whole answer within METRICS_DEADLINE_S (a per-read timeout
# alone let a trickling answer hold top for minutes) and METRICS_MAX_BYTES (the proxy's own
# exposition is tens of KB; a 300 MB answer is not its metrics)
METRICS_DEADLINE_S = 2.0
METRICS_MAX_BYTES = 16 << 20
HOPS = ("route", "answer", "summary")
ADAPTERS = ("L0", "L1", "L2", "L3")
P = "molctl_proxy_"

Labels = tuple[tuple[str, str], ...]


@dataclass
class Scrape:
    """One exposition: sample name -> {labels: value}, and when it was read."""

    samples: dict[str, dict[Labels, float]] = field(default_factory=dict)
    at: float = 0.0

    def total(self, name: str, **want: str) -> float:
        return sum(
            v
            for labels, v in self.samples.get(name, {}).items()
            if all(dict(labels).get(k) == x for k, x in want.items())
        )

    def buckets(self, name: str, **want: str) -> dict[float, float]:
        """le -> cumulative count of the histogram `name` (its `_bucket` samples), summed over the other labels."""
        out: dict[float, float] = {}
        for labels, v in self.samples.get(name + "_bucket", {}).items():
            d = dict(labels)
            if all(d.get(k) == x for k, x in want.items()):
                le = float(d["le"])
                out[le] = out.get(le, 0.0) + v
        return out


def parse(text: str, at: float | None = None) -> Scrape:
    """A Prometheus text exposition (prometheus-client's parser) as a Scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    scrape = Scrape(at=time.time() if at is None else at)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            scrape.samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return scrape


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """PromQL's histogram_quantile over cumulative bucket counts (le -> count): linear within the
    bucket the rank falls in; the lowest bucket starts at 0; a rank in +Inf answers the highest
    finite bound. None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = le, count
    return lower


def _delta(new: dict[float, float], old: dict[float, float]) -> dict[float, float]:
    return {k: v - old.get(k, 0.0) for k, v in new.items()}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _latency(new: Scrape, old: Scrape | None, name: str, **want: str) -> dict[str, Any]:
    buckets = _delta(new.buckets(name, **want), old.buckets(name, **want) if old else {})
    count = max(buckets.values(), default=0.0)
    return {"count": int(count), "p50_s": quantile(0.5, buckets), "p95_s": quantile(0.95, buckets)}


def numbers(new: Scrape, old: Scrape | None = None) -> dict[str, Any]:
    """The frame's numbers from the newer scrape and the older one (None: since the proxy started)."""
    start = new.total("process_start_time_seconds")
    since = old.at if old is not None else start or None
    window = new.at - since if since is not None and new.at > since else None

    def per_s(n: float) -> float | None:
        return n / window if window else None

    def grown(name: str, **want: str) -> float:
        return new.total(name, **want) - (old.total(name, **want) if old is not None else 0.0)

    # the answer hops by adapter (every answer: routed, fallen back or sticky; route_decisions_total misses sticky)
    answers = {a: grown(P + "hop_seconds_count", hop="answer", adapter=a) for a in ADAPTERS}
    answered = sum(answers.values())
    out: dict[str, Any] = {
        "window_s": round(window, 3) if window else None,
        "since_start": old is None,
        "requests_per_s": per_s(grown(P + "requests_total")),
        "hops": {hop: _latency(new, old, P + "hop_seconds", hop=hop) for hop in HOPS},
        "ttft": _latency(new, old, P + "time_to_first_token_seconds"),
        "adapter_mix": {a: _ratio(n, answered) for a, n in answers.items()},
        "cache_hit_ratio": {
            a: _ratio(
                grown(P + "cached_tokens_total", hop="answer", adapter=a),
                grown(P + "prompt_tokens_total", hop="answer", adapter=a),
            )
            for a in ADAPTERS
        },
        "admission": {
            "running": int(new.total(P + "num_requests_running")),
            "waiting": int(new.total(P + "num_requests_waiting")),
            "rejected_per_s": per_s(grown(P + "admission_rejections_total")),
        },
        "summaries": {
            "pending": int(new.total(P + "inflight_hops", hop="summary") + new.total(P + "queue_depth", hop="summary")),
            "done_per_s": per_s(grown(P + "summaries_total")),
            "failed": int(new.total(P + "summary_failures_total")),
        },
    }
    spec = P + "speculative_total"
    if new.total(spec, outcome="hit") + new.total(spec, outcome="miss") > 0:  # a speculative hop ran (not only skips)
        hit, miss = grown(spec, outcome="hit"), grown(spec, outcome="miss")
        out["speculative_hit_ratio"] = _ratio(hit, hit + miss)
    return out


def restarted(new: Scrape, old: Scrape) -> bool:
    """Whether the proxy restarted between two scrapes: another process start time, or a counter
    (a `_total`, or a histogram's `_count`/`_bucket`) that went down, as Prometheus finds a reset."""
    if new.total("process_start_time_seconds") != old.total("process_start_time_seconds"):
        return True
    for name, samples in old.samples.items():
        if name.endswith(("_total", "_count", "_bucket")):
            now = new.samples.get(name, {})
            if any(now.get(labels, 0.0) < v for labels, v in samples.items()):
                return True
    return False


def fetch_metrics(url: str) -> tuple[str | None, str | None]:
    """(The metrics listener's answer, None) or (None, why not): a 200 whose whole body came
    within METRICS_DEADLINE_S and METRICS_MAX_BYTES."""
    import httpx

    from molctl import localhttp

    deadline = time.monotonic() + METRICS_DEADLINE_S
    parts: list[bytes] = []
    size = 0
    try:
        with localhttp.client() as client, client.stream("GET", url, timeout=min(1.0, METRICS_DEADLINE_S)) as r:
            if r.status_code != 200:
                return None, f"it answers {r.status_code}"
            for chunk in r.iter_bytes():  # decoded: the bound holds for a compressed answer too
                parts.append(chunk)
                size += len(chunk)
                if size > METRICS_MAX_BYTES:
                    return None, f"its answer passed {METRICS_MAX_BYTES} bytes"
                if time.monotonic() > deadline:
                    return None, f"its answer took over {METRICS_DEADLINE_S:g} s"
    except httpx.HTTPError:
        return None, "it does not answer"
    return b"".join(parts).decode("utf-8", errors="replace"), None


def unanswered_phase(phase: str | None, pid: int | None) -> str | None:
    """The engine's phase when its /health does not answer 200: its log's phase, except that a
    process stopped by a signal (SIGSTOP, a debugger) is "stopped", and one whose log says it
    was serving is "not answering": its last log line is not its state now."""
    import psutil

    try:
        if pid is not None and psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            return "stopped (SIGSTOP)"
    except psutil.Error:
        pass
    return "not answering" if phase is not None and phase.endswith("serving") else phase


# ---------------------------------------------------------------------------- the stack


@dataclass
class Target:
    """The running stack top shows: its profile name, the engine kind's log phases, the metrics URL."""

    profile: str
    engine: Any  # molctl.engines.base.Engine
    engine_log: str | None
    metrics_url: str | None


def find_target(ctx, name: str | None) -> Target:
    """The named stack, or the one running; NothingRunning (exit 3, one line) when nothing of it runs."""
    from molctl.engines import get_engine
    from molctl.lifecycle.stacks import known_or_recorded
    from molctl.lifecycle.status import metrics_url
    from molctl.state import check_readable, is_same_process, profiles_with_records, read_records_checked

    check_readable(ctx.state_dir)
    if name is not None:
        known_or_recorded(ctx, name)
    names = [name] if name is not None else profiles_with_records(ctx.state_dir) if ctx.state_dir.exists() else []
    for n in names:
        records, _ = read_records_checked(ctx.state_dir, n)
        if not any(is_same_process(r) for r in records.values()):
            continue
        profile = running_profile(ctx, n, records)
        engine = records.get("engine")
        return Target(
            n,
            get_engine(profile.engine.kind),
            engine.log if engine is not None else None,
            metrics_url(profile) if profile.proxy.metrics_port else None,
        )
    who = f" for {name}" if name is not None else ""
    raise NothingRunning(f"nothing is running{who} (molctl up {name or 'PROFILE'} starts a stack)")


class Top:
    """The frames of one `molctl top`: the stack's state and the numbers from the scrapes kept."""

    def __init__(self, ctx, target: Target):
        self.ctx, self.target = ctx, target
        self.scrapes: deque[Scrape] = deque()
        self.why: str | None = None  # why the last scrape gave no metrics

    def scrape(self) -> Scrape | None:
        """The proxy's metrics now, or None (why in `self.why`: no answer, not 200, past the
        deadline or the size bound, not Prometheus text)."""
        self.why = None
        if self.target.metrics_url is None:
            return None
        text, self.why = fetch_metrics(self.target.metrics_url)
        if text is None:
            return None
        try:
            return parse(text)
        except (ValueError, TypeError, IndexError, KeyError):  # prometheus-client's parser on other text
            self.why = "its answer is not Prometheus text"
            return None

    def state(self) -> dict[str, Any]:
        """The stack's state and, while the engine is not ready, its load phase (from its log)."""
        from molctl.lifecycle.status import status
        from molctl.processes import tail

        stacks = status(self.ctx, self.target.profile)["stacks"]
        stack = stacks[0] if stacks else {"state": "stopped", "components": []}
        engine = next((c for c in stack["components"] if c["name"] == "engine"), None)
        phase = None
        if engine is not None and engine["alive"]:
            phase = "serving" if engine["health"] == 200 else "starting"
            if engine["health"] != 200 and self.target.engine_log:
                phase = self.target.engine.phase(tail(self.target.engine_log, 50)) or phase
            if engine["health"] != 200:
                phase = unanswered_phase(phase, engine.get("pid"))
        health = {c["name"]: c["health"] for c in stack["components"]}
        # while the stack starts: the time left from this host's earlier starts (molctl.lifecycle.starthistory)
        return {"state": stack["state"], "engine_phase": phase, "health": health, "eta_s": stack.get("eta_s")}

    def snapshot(self) -> dict[str, Any]:
        """One frame's data: {"profile", "state", "engine_phase", "health", "metrics"}; metrics is
        None when the profile has no proxy.metrics_port or its listener did not answer."""
        out: dict[str, Any] = {"profile": self.target.profile, **self.state()}
        scrape = self.scrape()
        if scrape is None:
            out["metrics"] = None
            return out
        out["metrics"] = numbers(scrape, self.older(scrape))
        return out

    def older(self, scrape: Scrape) -> Scrape | None:
        """Keep `scrape` in the ring and return the one about WINDOW_S before it (None: the first
        scrape, or the first since the proxy restarted, whose counters began again from 0)."""
        if self.scrapes and restarted(scrape, self.scrapes[-1]):
            self.scrapes.clear()
        self.scrapes.append(scrape)
        while len(self.scrapes) > 1 and scrape.at - self.scrapes[1].at >= WINDOW_S:
            self.scrapes.popleft()
        return self.scrapes[0] if len(self.scrapes) > 1 else None


# ---------------------------------------------------------------------------- rendering


def _s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def frame(snap: dict[str, Any], metrics_url: str | None = None, live: bool = False, why: str | None = None):
    """A rich renderable of one snapshot (`live`: with the key that quits; `why`: why the
    metrics are missing, `Top.why`)."""
    from rich.columns import Columns
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text.assemble(
        ("molctl top ", "bold"),
        (snap["profile"], "bold cyan"),
        f"  state {snap['state']}",
        f"  engine {snap['engine_phase'] or '-'}",
        f"  ETA {snap['eta_s']:.0f} s" if snap.get("eta_s") is not None else "",
        "  (q quits)" if live else "",
    )
    m = snap["metrics"]
    if m is None:
        why = "no proxy.metrics_port in the profile" if metrics_url is None else f"{metrics_url}: {why or 'no answer'}"
        return Group(head, Text(f"no proxy metrics: {why}", style="yellow"))
    span = "since the proxy started" if m["since_start"] else f"last {m['window_s']:.0f} s"
    summary = Text(
        f"requests/s {_rate(m['requests_per_s'])} ({span})   admission: {m['admission']['running']} running, "
        f"{m['admission']['waiting']} waiting, {_rate(m['admission']['rejected_per_s'])} rejected/s   "
        f"summaries pending {m['summaries']['pending']}, failed {m['summaries']['failed']}"
        + (f"   speculative hit ratio {_pct(m['speculative_hit_ratio'])}" if "speculative_hit_ratio" in m else "")
    )
    latency = Table(title="latency", header_style="bold", title_justify="left")
    for col in ("", "count", "p50", "p95"):
        latency.add_column(col, justify="right" if col else "left")
    for name, row in [*m["hops"].items(), ("ttft", m["ttft"])]:
        latency.add_row(name, str(row["count"]), _s(row["p50_s"]), _s(row["p95_s"]))
    adapters = Table(title="adapters", header_style="bold", title_justify="left")
    for col in ("", "mix", "cache hit"):
        adapters.add_column(col, justify="right" if col else "left")
    for a in ADAPTERS:
        adapters.add_row(a, _pct(m["adapter_mix"][a]), _pct(m["cache_hit_ratio"][a]))
    # side by side where they fit, else one under the other (a narrow terminal): never squeezed into ellipses
    return Group(head, summary, Columns([latency, adapters], padding=(0, 4)))


# ---------------------------------------------------------------------------- the command


def run(ctx, name: str | None, once: bool, as_json: bool, out) -> None:
    """`molctl top`: --json prints one snapshot's numbers, --once one frame; else the live view
    until q (returns) or Ctrl-C (KeyboardInterrupt: the CLI's exit 130); not on a terminal, a
    frame a second until Ctrl-C or the reader goes away (rich's broken-pipe exit: quietly, 1)."""
    target = find_target(ctx, name)
    top = Top(ctx, target)
    if as_json:
        out.json(top.snapshot())
        return
    if once:
        out.console.print(frame(top.snapshot(), target.metrics_url, why=top.why))
        return
    _live(top, out)


def _live(top: Top, out) -> None:
    from rich.live import Live

    if not out.console.is_terminal:  # a pipe or a file: a frame a second, one after another (as `top -b`)
        while True:
            snap = top.snapshot()
            out.console.print(frame(snap, top.target.metrics_url, why=top.why))  # written and flushed at once
            time.sleep(REFRESH_S)
    snaps = _Snapshots(top)
    with _Keys() as keys, Live(console=out.console, auto_refresh=False, screen=False) as live:
        while True:
            snap, why = snaps.latest()
            live.update(frame(snap, top.target.metrics_url, live=True, why=why), refresh=True)
            deadline = time.monotonic() + REFRESH_S
            while (left := deadline - time.monotonic()) > 0:
                if keys.read(left) in ("q", "Q"):
                    return


class _Snapshots:
    """Snapshots taken one after another in a daemon thread, so that the live view draws a frame
    every REFRESH_S and reads keys all the time, however long the stack takes to answer (a
    stopped proxy's probes time out: 6 s a frame, q unread meanwhile). A snapshot older than
    2 x REFRESH_S is shown with its age."""

    def __init__(self, top: Top):
        import threading

        self.top = top
        self.lock = threading.Lock()
        self.snap: tuple[dict[str, Any], str | None, float] | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._run, name="molctl-top-snapshots", daemon=True).start()

    def _run(self) -> None:
        while True:
            started = time.monotonic()
            snap = self.top.snapshot()
            with self.lock:
                self.snap = (snap, self.top.why, time.monotonic())
            self.ready.set()
            time.sleep(max(0.0, REFRESH_S - (time.monotonic() - started)))

    def latest(self) -> tuple[dict[str, Any], str | None]:
        """The newest snapshot (waiting for the first one) and why its metrics are missing."""
        self.ready.wait()
        with self.lock:
            snap, why, at = self.snap  # type: ignore[misc]
        age = time.monotonic() - at
        if age > 2 * REFRESH_S:
            snap = {**snap, "state": f"{snap['state']} (as of {age:.0f} s ago: the stack is slow to answer)"}
        return snap, why


class _Keys:
    """Single key presses from the terminal (cbreak mode: Ctrl-C still interrupts), restored on exit;
    without a terminal on stdin, none (only Ctrl-C ends the view)."""

    def __enter__(self) -> _Keys:
        import sys
        import termios
        import tty

        self.fd, self.saved = None, None
        if sys.stdin.isatty():
            self.fd = sys.stdin.fileno()
            self.saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def read(self, timeout: float) -> str | None:
        import os
        import select

        if self.fd is None:
            time.sleep(timeout)
            return None
        ready, _, _ = select.select([self.fd], [], [], timeout)
        return os.read(self.fd, 1).decode("latin-1") if ready else None

    def __exit__(self, *exc) -> None:
        import termios

        if self.fd is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)
