"""Terminal control characters in log text are escaped, so a log cannot drive the terminal of
whoever reads it (colours, cursor moves, a rewritten line, a title): when the proxy writes its log
(an engine's error message quoted in a warning), and when `molctl logs` prints any log (the
engine's own output, written by the engine). Tabs and line ends stay."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx

from molctl.logfiles import escape_controls
from molctl.logs import _Log
from tests.helpers import free_ports, wait_for
from tests.procs import fake_engine_argv, proxy_argv, running
from tests.proxy_stack import PUBLIC

HOSTILE = "\x1b[31mred\x1b[0m \x1b]0;owned\x07 back\x08\x08 \r rewritten \x9b2J \x7f end\tok"


class _Out:
    def __init__(self) -> None:
        self.stdout = io.StringIO()

    def raw(self, text: str) -> None:
        self.stdout.write(text)


def test_escape_controls_shows_every_control_character_and_keeps_tabs():
    shown = escape_controls(HOSTILE)
    assert not any(ch in shown for ch in "\x1b\x07\x08\r\x9b\x7f"), shown
    assert shown == ("\\x1b[31mred\\x1b[0m \\x1b]0;owned\\x07 back\\x08\\x08 \\x0d rewritten \\x9b2J \\x7f end\tok")


def test_molctl_logs_prints_a_log_with_its_control_characters_escaped(tmp_path: Path):
    path = tmp_path / "engine.log"
    path.write_bytes(("INFO " + HOSTILE + "\n").encode() + b"raw \x1b[2K line\r\n")
    out = _Out()
    log = _Log("engine", path, out, set())  # type: ignore[arg-type]
    try:
        log.tail(10, follow=False)
    finally:
        log.close()
    text = out.stdout.getvalue()
    assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text, repr(text)
    assert text.splitlines() == ["[engine] INFO " + escape_controls(HOSTILE), "[engine] raw \\x1b[2K line"]


def test_the_proxy_writes_an_engine_message_into_its_log_escaped(tmp_path: Path):
    engine_port, port = free_ports(2)
    engine_url, url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{port}"
    error = {"status": 500, "body": {"error": {"message": "boom " + HOSTILE, "code": 500}}}
    log = tmp_path / "proxy.log"
    with (
        running(fake_engine_argv(engine_port, {"answer_error": error}), engine_url + "/health"),
        running(
            proxy_argv("tiny", engine_url, port, "--allow-unauthenticated", "--store", "memory"),
            url + "/health",
            log=log,
        ),
    ):
        r = httpx.post(
            url + "/v1/chat/completions",
            timeout=30,
            json={"model": PUBLIC, "messages": [{"role": "user", "content": "[route:L2] hi"}]},
        )
        assert r.status_code == 502, r.text
        assert wait_for(lambda: "answer hop" in log.read_text(), 10)
    raw = log.read_bytes()
    warning = next(line for line in raw.decode().splitlines() if "answer hop" in line)
    assert "\\x1b[31mred" in warning, warning
    for ch in (b"\x1b", b"\x07", b"\x08", b"\xc2\x9b"):
        assert ch not in raw, (ch, raw[-2000:])
    assert json.loads(next(line for line in raw.decode().splitlines() if line.startswith("{")))["status"] == 502
