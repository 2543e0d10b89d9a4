"""The one place that renders results: rich tables for people, JSON for machines.

Commands hand plain data (dicts, reports) to an `Output`; nothing else prints."""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable, TextIO

STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


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

            self._console = Console(file=self.stdout, highlight=False, soft_wrap=False)
        return self._console

    # primitives -------------------------------------------------------------------------
    def json(self, data: Any) -> None:
        self.stdout.write(json.dumps(data, indent=2) + "\n")

    def line(self, text: str, style: str | None = None) -> None:
        if self.as_json:
            return
        self.console.print(text, style=style, markup=False)

    def error(self, message: str) -> None:
        self.stderr.write(f"molctl: error: {message}\n")

    def warn(self, message: str) -> None:
        self.stderr.write(f"molctl: warning: {message}\n")

    def table(self, columns: Iterable[str], rows: Iterable[Iterable[Any]], title: str | None = None) -> None:
        from rich.table import Table

        table = Table(title=title, show_lines=False, header_style="bold")
        for col in columns:
            table.add_column(col, overflow="fold")
        for row in rows:
            table.add_row(*row)
        self.console.print(table)

    # renderers --------------------------------------------------------------------------
    def check_report(self, report) -> None:
        if self.as_json:
            self.json(report.as_dict())
            return
        from rich.text import Text

        rows = [(Text(c.status.upper(), style=STATUS_STYLE[c.status]), c.id, Text(c.detail)) for c in report.checks]
        self.table(("status", "id", "detail"), rows, title=f"molctl check {report.profile}")
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
            [(r["name"], f"{r['engine']} {r['engine_version']}", r["served_model_name"], str(r["gpus"]),
              str(r["engine_port"]), str(r["proxy_port"]), r["source"]) for r in rows],
        )
