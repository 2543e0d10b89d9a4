"""The one place that renders results: rich tables for people, JSON for machines.

Commands hand plain data (dicts, reports) to an `Output` method; nothing else prints. The
progress of `up`, `down` and `switch` (`molctl.lifecycle.progress.Progress`) is `ConsoleProgress`."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any, TextIO

STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F) if c != 0x09} | {0x0A: "\\n", 0x0D: "\\r"}


def one_line(message: str) -> str:
    """An error or warning as one line whatever it quotes: a newline or another control character
    but a tab (a path named so, a value read from a file) is escaped as Python writes it (`\\n`, `\\x1b`)."""
    return message.translate(_CONTROL)


class Output:
    def __init__(self, as_json: bool = False, stdout: TextIO | None = None, stderr: TextIO | None = None):
        self.as_json = as_json
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self._console = None

    @property
    def console(self):
        if self._console is None:
            from rich.console import Console

            tty = hasattr(self.stdout, "isatty") and self.stdout.isatty()
            # not a terminal (a pipe, a log, CI): wide enough that paths and details stay on one line
            self._console = Console(file=self.stdout, highlight=False, soft_wrap=False, width=None if tty else 200)
        return self._console

    # primitives -------------------------------------------------------------------------
    def json(self, data: Any) -> None:
        self.stdout.write(json.dumps(data, indent=2) + "\n")

    def line(self, text: str, style: str | None = None) -> None:
        if self.as_json:
            return
        self.console.print(text, style=style, markup=False, soft_wrap=True)

    def raw(self, text: str) -> None:
        """Unformatted text (log lines), flushed at once."""
        self.stdout.write(text)
        self.stdout.flush()

    def error(self, message: str) -> None:
        self.stderr.write(f"molctl: error: {one_line(message)}\n")

    def warn(self, message: str) -> None:
        self.stderr.write(f"molctl: warning: {one_line(message)}\n")

    def table(self, columns: Iterable[str], rows: Iterable[Iterable[Any]], title: str | None = None) -> None:
        from rich.table import Table

        table = Table(title=title, show_lines=False, header_style="bold")
        for col in columns:
            table.add_column(col, overflow="fold")
        for row in rows:
            table.add_row(*row)
        self.console.print(table)

    # renderers --------------------------------------------------------------------------
    def check_report(self, report, problems_only: bool = False) -> None:
        """The check table; `problems_only` (the preflight of up/switch) shows failures and warnings."""
        if self.as_json:
            self.json(report.as_dict())
            return
        from rich.text import Text

        checks = [c for c in report.checks if c.status in ("fail", "warn")] if problems_only else report.checks
        rows = [(Text(c.status.upper(), style=STATUS_STYLE[c.status]), c.id, Text(c.detail)) for c in checks]
        title = f"molctl check {report.profile}" + (" (failures and warnings)" if problems_only else "")
        self.table(("status", "id", "detail"), rows, title=title)
        n = report.counts()
        summary = f"{n['pass']} passed, {n['warn']} warnings, {n['fail']} failed, {n['skip']} skipped"
        if report.ok:
            self.console.print(Text(f"OK: profile {report.profile} is ready to start ({summary})", style="bold green"))
        else:
            self.console.print(Text(f"FAILED: profile {report.profile} would not start ({summary})", style="bold red"))

    def profiles(self, rows: list[dict[str, Any]]) -> None:
        if self.as_json:
            self.json({"profiles": rows})
            return
        self.table(
            ("name", "engine", "served model", "GPUs", "engine port", "proxy port", "source"),
            [
                (
                    r["name"],
                    f"{r['engine']} {r['engine_version']}",
                    r["served_model_name"],
                    str(r["gpus"]),
                    str(r["engine_port"]),
                    str(r["proxy_port"]),
                    r["source"],
                )
                for r in rows
            ],
        )

    def up_result(self, result: dict) -> None:
        """`up` / `switch` succeeded."""
        if self.as_json:
            self.json({"ok": True, **result})
            return
        t = result.get("timings", {})
        took = f" in {t['total_s']:.1f} s" if "total_s" in t else ""
        verb = "is already running" if result.get("already_running") else f"is ready{took}"
        self.line(f"{result['profile']} {verb}: model {result['model']} at {result['endpoint']}")
        if result.get("stopped"):
            self.line(f"stopped {', '.join(result['stopped'])} first ({t.get('stop_s', 0):.1f} s)")
        if result.get("prefetch"):
            p = result["prefetch"]
            self.line(
                f"prefetched {p['files_read']} of {p['files']} files ({p['bytes_read'] / 2**30:.2f} GiB) "
                f"while the old stack drained"
            )
        if t.get("phases"):
            from molctl.phases import LABELS

            parts = ", ".join(f"{LABELS.get(p, p)} {s:.1f} s" for p, s in t["phases"].items())
            eta = (result.get("eta") or {}).get("expected_total_s")
            expected = f" (expected {eta:.0f} s)" if eta is not None else " (no earlier start to compare)"
            self.line(f"phases: {parts}{expected}")

    def prefetch_result(self, profile: str, summary: dict) -> None:
        """`molctl prefetch`: what was read into the page cache, what was skipped and why."""
        if self.as_json:
            self.json({"profile": profile, **summary})
            return
        gib = 2**30
        self.line(
            f"{profile}: read {summary['files_read']} of {summary['files']} files "
            f"({summary['bytes_read'] / gib:.2f} of {summary['bytes_total'] / gib:.2f} GiB) "
            f"into the page cache in {summary['seconds']:.1f} s"
        )
        for skipped in summary["skipped"]:
            self.line(f"skipped {skipped['file']}: {skipped['reason']}")

    def start_failure(self, profile: str, exc) -> None:
        """`up` / `switch` failed: with --json the whole failure (the preflight's checks included),
        else the tail of the failing component's log on stderr (the error line follows)."""
        tail = getattr(exc, "log_tail", [])
        if self.as_json:
            data = {
                "ok": False,
                "profile": profile,
                "exit_code": int(exc.exit_status),
                "error": str(exc),
                "log_tail": tail,
            }
            report = getattr(exc, "report", None)
            if report is not None:
                data["checks"] = report.as_dict()["checks"]
            self.json(data)
        elif tail:
            self.stderr.write("".join(f"  | {line}\n" for line in tail))

    def down_result(self, result: dict) -> None:
        if self.as_json:
            self.json(result)
        else:
            self.line(result["message"])

    def status(self, data: dict) -> None:
        if self.as_json:
            self.json(data)
            return
        if not data["stacks"]:
            self.line("no stack is recorded (molctl up PROFILE starts one)")
            return
        from rich.text import Text

        style = {
            "ready": "green",
            "starting": "yellow",
            "degraded": "yellow",
            "stopping": "yellow",
            "failed": "bold red",
            "stopped": "dim",
        }
        rows = []
        for stack in data["stacks"]:
            comps = stack["components"] or [
                {"name": "-", "pid": "-", "alive": False, "port": "-", "health": None, "log": "", "uptime_s": None}
            ]
            for c in comps:
                up_s = c.get("uptime_s")
                rows.append(
                    (
                        stack["profile"],
                        Text(stack["state"], style=style.get(stack["state"], "")),
                        c["name"],
                        str(c["pid"]),
                        "yes" if c["alive"] else "no",
                        str(c["port"]),
                        str(c["health"] or "-"),
                        _duration(up_s) if up_s is not None else "-",
                        c["log"],
                    )
                )
        self.table(("profile", "state", "component", "pid", "alive", "port", "health", "uptime", "log"), rows)
        for stack in data["stacks"]:
            if stack.get("endpoint") and stack["state"] in ("ready", "degraded"):
                self.line(f"{stack['profile']}: model {stack.get('model')} at {stack['endpoint']}")
            pm = stack.get("proxy_metrics")
            if pm and pm.get("available"):
                self.line(
                    f"{stack['profile']}: proxy "
                    + ", ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in pm.items() if k not in ("available", "url"))
                )
            for c in stack["components"]:
                if c.get("detail"):
                    self.line(f"{stack['profile']}: {c['name']} (pid {c['pid']}) not healthy: {c['detail']}")
            for problem in stack.get("problems", []):
                self.line(f"{stack['profile']}: {problem}")
            if stack.get("adapters") not in (None, "ok"):
                self.line(f"{stack['profile']}: adapters: {stack['adapters']}")
            if stack.get("canary"):
                from molctl.lifecycle.canary import summary_line

                self.line(f"{stack['profile']}: {summary_line(stack['canary'])}")
            if stack.get("phase"):
                from molctl.phases import label

                basis = (stack.get("eta") or {}).get("basis", "")
                if stack.get("eta_s") is not None:
                    eta = f"ETA {stack['eta_s']:.0f} s"
                elif basis.startswith("no usable history"):
                    eta = f"no ETA ({basis})"
                else:
                    eta = "no ETA (first start here)"
                self.line(
                    f"{stack['profile']}: starting: {label(stack['phase'], stack.get('phase_detail', ''))}; {eta}"
                )
            if stack.get("cache"):
                c = stack["cache"]
                hit = "warm" if c.get("warm") else "empty"
                compiled = f", compile cache {c['compile_cache']}" if c.get("compile_cache") else ""
                by = f", set by {c['set_by']}" if c.get("set_by") else ""
                self.line(f"{stack['profile']}: engine cache {c.get('dir')} ({hit} at the last start{compiled}{by})")
            for g in stack.get("gpus", []):
                self.line(f"  GPU {g['index']}: {g['used_bytes'] / 2**30:.1f} GiB used by the stack")

    def hash_progress(self):
        """The progress of `molctl lock`'s hashing: a bar with bytes/s and ETA on stderr when it is a
        terminal, else None (silent; also with --json, like the progress of up/down/switch)."""
        tty = hasattr(self.stderr, "isatty") and self.stderr.isatty()
        return HashProgressBar(self.stderr) if tty and not self.as_json else None

    def lock_result(self, summary: dict) -> None:
        """`molctl lock` wrote its manifest."""
        if self.as_json:
            self.json(summary)
            return
        cached = f", {summary['cached_files']} from the hash cache" if summary["cached_files"] else ""
        self.line(
            f"locked {summary['profile']} ({summary['engine']['kind']} {summary['engine']['version']}): "
            f"{summary['files']} files, {_bytes(summary['bytes'])}; read {summary['hashed_files']} "
            f"({_bytes(summary['hashed_bytes'])}){cached} in {summary['seconds']:.1f} s"
        )
        self.line(f"manifest: {summary['manifest']}")

    def demo_init(self, result: dict, template: str, seed: int) -> None:
        if self.as_json:
            self.json(result)
        elif result.get("template_added"):
            self.line(f"tiny model already present in {result['root']}; added the {template} chat template")
        elif not result["created"]:
            self.line(f"tiny model already present in {result['root']}")
        else:
            self.line(
                f"tiny model written to {result['root']} (vocab {result['vocab_size']}, adapters L0-L3, "
                f"{template} chat template, seed {seed})"
            )

    def bench(self, data: dict) -> None:
        """`molctl bench`: one table per series (ratios to base-only at the same concurrency), or
        `--compare`'s differences (data with "rows")."""
        if self.as_json:
            self.json(data)
            return
        ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
        num = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
        if "rows" in data:
            rows = []
            for r in data["rows"]:
                a, b, q = r["a"] or {}, r["b"] or {}, r["ratio"] or {}
                rows.append(
                    (
                        r["series"],
                        str(r["concurrency"]),
                        *(
                            f"{ms(a.get(k))} -> {ms(b.get(k))} ({num(q.get(k), '{:.2f}x')})"
                            for k in ("ttft_p50", "total_p50", "total_p95")
                        ),
                        f"{num(a.get('requests_per_s'))} -> {num(b.get('requests_per_s'))} "
                        f"({num(q.get('requests_per_s'), '{:.2f}x')})",
                        f"{a.get('errors', '-')} -> {b.get('errors', '-')}",
                    )
                )
            self.table(
                ("series", "conc", "TTFT p50 ms", "total p50 ms", "total p95 ms", "req/s", "errors"),
                rows,
                title=f"molctl bench --compare {data['a']['run_id']} {data['b']['run_id']} (B/A)",
            )
            return
        for series in dict.fromkeys(c["series"] for c in data["results"]):
            rows = []
            for c in (c for c in data["results"] if c["series"] == series):
                vs = c["vs_base"] or {}
                errs = ", ".join(f"{k} {v}" for k, v in sorted(c["errors"].items())) or "0"
                vram = ", ".join(f"{g['index']}: {g['used_bytes'] / 2**30:.1f}G" for g in c["vram_peak"] or []) or "-"
                rows.append(
                    (
                        str(c["concurrency"]),
                        f"{c['ok']}/{c['requests']}",
                        *(ms(c[m][p]) for m in ("ttft_s", "total_s") for p in ("p50", "p95", "p99")),
                        num(c["output_tokens_per_s"], "{:.1f}"),
                        num(c["requests_per_s"]),
                        num(vs.get("total_p50"), "{:.2f}x"),
                        errs,
                        vram,
                    )
                )
            self.table(
                (
                    "conc",
                    "ok",
                    "TTFT p50",
                    "p95",
                    "p99",
                    "total p50",
                    "p95",
                    "p99",
                    "tok/s",
                    "req/s",
                    "total p50 vs base",
                    "errors",
                    "VRAM peak",
                ),
                rows,
                title=f"{series} (ms)",
            )
            for c in (c for c in data["results"] if c["series"] == series and c.get("by_adapter")):
                self.line(
                    "  by adapter at concurrency {}: {}".format(
                        c["concurrency"],
                        "; ".join(
                            f"{k} p50 {ms(v['total_s']['p50'])} p95 {ms(v['total_s']['p95'])} ms, {sum(v['errors'].values())} err"
                            for k, v in c["by_adapter"].items()
                        ),
                    )
                )
        if data["vram"]["note"]:
            self.line(data["vram"]["note"])
        self.line(
            f"run {data['run_id']}: {data['run_dir']}" + ("" if data["manifest"] else " (no molctl lock manifest)")
        )

    def state_stats(self, data: dict) -> None:
        """`molctl state stats`: the response store of a profile."""
        if self.as_json:
            self.json(data)
            return
        self.line(_store_where(data))
        if data["exists"]:
            self.line(_store_counts(data))

    def state_prune(self, data: dict) -> None:
        """`molctl state prune`: what was removed and what remains."""
        if self.as_json:
            self.json(data)
            return
        self.line(_store_where(data))
        if data["exists"]:
            r = data["removed"]
            self.line(
                f"pruned: {r['expired']} expired, {r['evicted']} evicted over the caps; chat conversation rows: "
                f"{r.get('conversation_expired', 0)} expired, {r.get('conversation_evicted', 0)} evicted; "
                f"now {_store_counts(data)}"
            )


class HashProgressBar:
    """A `molctl.hashing.HashProgress`: one rich bar (files, bytes, bytes/s, ETA), removed when
    done. `advance` is called from the hashing threads (rich's Progress is thread-safe)."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self._progress = None
        self._task = None

    def start(self, files: int, total_bytes: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn(f"hashing {files} file(s)"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(file=self.stream),
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task("hash", total=total_bytes)

    def advance(self, nbytes: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, nbytes)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class ConsoleProgress:
    """The `molctl.lifecycle.progress.Progress` of `up`, `down` and `switch`: a live spinner while waiting on
    a terminal, plain lines otherwise; with --json only warnings (on stderr)."""

    PLAIN_EVERY_S = 10.0

    def __init__(self, out: Output):
        self.out = out
        self.tty = (not out.as_json) and out.stdout.isatty()
        self._status = None
        self._last_line = (None, -1e9)

    def step(self, message: str) -> None:
        if self.out.as_json:
            return
        self._stop_status()
        self.out.line(f"molctl: {message}")

    def warn(self, message: str) -> None:
        self._stop_status()
        self.out.warn(message)

    def countdown(self, what: str, seconds_left: float) -> None:
        self.step(f"{what}: still running; SIGKILL in {seconds_left:.0f} s")

    def waiting(self, elapsed: float, deadline: float, phase: str, detail: str, eta: str | None = None) -> None:
        if self.out.as_json:
            return
        text = f"waiting for the engine: {phase} ({elapsed:.0f}s of {deadline:.0f}s; {detail})"
        if eta:
            text += f"; {eta}"
        if self.tty:
            if self._status is None:
                self._status = self.out.console.status(text)
                self._status.start()
            else:
                self._status.update(text)
            return
        last_phase, last_t = self._last_line
        if phase != last_phase or elapsed - last_t >= self.PLAIN_EVERY_S:
            self.out.line(f"molctl: {text}")
            self._last_line = (phase, elapsed)

    def check_report(self, report) -> None:
        self._stop_status()
        if not self.out.as_json:
            self.out.check_report(report, problems_only=True)

    def _stop_status(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def close(self) -> None:
        self._stop_status()


def _ttl(seconds: float) -> str:
    """2592000 -> '2592000 s (30 days)'; short ones in seconds only (`:g` printed 2.592e+06 s)."""
    text = f"{seconds:.0f} s" if seconds == int(seconds) else f"{seconds} s"
    if seconds >= 86400:
        text += f" ({seconds / 86400:g} days)"
    elif seconds >= 3600:
        text += f" ({seconds / 3600:g} hours)"
    return text


def _bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _store_where(data: dict) -> str:
    if data["backend"] == "redis":
        r = data["redis"]
        return (
            f"{data['profile']}: {r['address']} (redis {r['redis_version']}, shared by {len(r['replicas'])} registered "
            f"replica(s): {', '.join(r['replicas']) or '-'}; maxmemory {r['maxmemory'] or 'unset'}, "
            f"policy {r['maxmemory_policy']}, used {_bytes(r['used_memory'])})"
        )
    if data["backend"] == "memory":
        return f"{data['profile']}: proxy.store is memory: responses live in the proxy process only (nothing on disk)"
    if not data["exists"]:
        return f"{data['profile']}: {data['path']} does not exist yet (created by the proxy's first start)"
    return f"{data['profile']}: {data['path']} (sqlite, schema {data['schema_version']})"


def _store_counts(data: dict) -> str:
    import datetime

    if data["backend"] == "redis":
        r, b = data["redis"], data["bounds"]
        return (
            f"{r['responses']} response(s), {r['conversation_rows']} chat conversation row(s) (turns and tool calls); "
            f"evicted {r['responses_evicted']} + {r['conversation_evicted']}; bounds: ttl {_ttl(b['ttl_s'])} per key "
            f"(Redis expires them), {b['max_entries']} per group"
        )

    oldest = data["oldest_created_at"]
    when = (
        "-"
        if oldest is None
        else datetime.datetime.fromtimestamp(oldest, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    )
    b = data["bounds"]
    return (
        f"{data['responses']} response(s), {_bytes(data['bytes'])} of records ({_bytes(data['file_bytes'])} on disk), "
        f"oldest {when}; {data['expired_pending']} expired not yet pruned; evicted {data['evicted']}, expired "
        f"{data['expired']} since created; bounds: ttl {_ttl(b['ttl_s'])}, {_bytes(b['max_bytes'])}, {b['max_entries']} responses"
        + _conversation_counts(data.get("conversations"))
    )


def _conversation_counts(c: dict | None) -> str:
    if not c:
        return ""
    return (
        f"; chat conversations: {c['turns']} turn(s), {c['calls']} tool call(s), {_bytes(c['bytes'])}, "
        f"{c['expired_pending']} expired not yet pruned, evicted {c['evicted']}, expired {c['expired']} "
        f"(same bounds, counted apart)"
    )
