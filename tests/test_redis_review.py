"""Adversarial review of the shared Redis store and the proxy replicas (molctl.proxy.redis_store):
each test reproduces a defect found by experiment against real processes (`molctl proxy`, the fake
engine, a real redis-server, the openai SDK) and pins its fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from molctl.errors import ExitStatus
from molctl.proxy.redis_store import parse_redis_url
from tests.helpers import ROOT

# ------------------------------------------------------------------------------ proxy.store URLs


@pytest.mark.parametrize("url, why", [
    ("redis://127.0.0.1:0/0", "port is not a number from 1 to 65535"),  # was: silently port 6379
    ("redis://127.0.0.1:6379/\u0663", "database must be a number"),  # an Arabic-Indic 3: was db 3
    ("redis://[::1/0", "expected redis://host:port/db"),  # was: the bare "Invalid IPv6 URL"
])
def test_a_malformed_store_url_is_refused_naming_what_was_expected(url, why):
    with pytest.raises(ValueError, match=why):
        parse_redis_url(url)
    out = subprocess.run([sys.executable, "-m", "molctl", "proxy", "tiny", "--upstream", "http://127.0.0.1:9",
                          "--allow-unauthenticated", "--set", f"proxy.store={url}"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == ExitStatus.CHECK_FAILED and len(lines) == 1, out.stderr
    assert "proxy.store" in lines[0] and why in lines[0]


def test_an_ipv6_store_address_is_shown_in_brackets():
    assert parse_redis_url("redis://[::1]:6380/2").address == "redis://[::1]:6380/2"  # was redis://::1:6380/2
