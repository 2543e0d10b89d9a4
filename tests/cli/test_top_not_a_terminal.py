"""`molctl top` with its output in a pipe: a frame a second, one after another (as `top -b`), until
the reader goes away; a live view (redrawn in place) needs a terminal."""

from __future__ import annotations

import openai

from molctl.errors import ExitStatus
from tests.helpers import free_port


def test_a_pipe_gets_a_frame_a_second_until_the_reader_goes_away(host):
    """Guards a found bug: into a pipe or a file the live view wrote nothing at all, ever."""
    r = host.up("--set", f"proxy.metrics_port={free_port()}")
    assert r.exit_code == ExitStatus.OK, r.stderr
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{host.proxy_port}/v1", api_key="none", max_retries=0)
    client.chat.completions.create(model="Macaron-Tiny-Demo", messages=[{"role": "user", "content": "[route:L1] hi"}])
    top = host.cli.start("top", "tiny")
    try:
        heads = []
        while len(heads) < 2:  # two frames, one after the other
            line = top.stdout.readline()
            assert line, top.stderr.read()
            if line.startswith("molctl top tiny"):
                heads.append(line)
        assert "state ready" in heads[1] and "(q quits)" not in heads[1]
        top.stdout.close()  # the reader goes away: the next frame ends it, quietly
        assert top.wait(timeout=30) in (0, 1)
        assert top.stderr.read() == ""
    finally:
        if top.poll() is None:
            top.kill()
            top.wait()
