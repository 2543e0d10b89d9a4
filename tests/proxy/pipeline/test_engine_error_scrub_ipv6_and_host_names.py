"""An engine's error message loses unbracketed IPv6 addresses and internal `host:port` names
(issue 40): the scrubber knew IPv4, localhost and `[v6]` only, so `fe80::1` and
`engine-0.molctl.svc.cluster.local:8000` reached the client."""

from __future__ import annotations

import pytest

from molctl.engines import get_engine
from molctl.profiles import load_profile, profile_dirs
from molctl.proxy.errors import EngineHTTPError, from_engine
from molctl.proxy.http.app import ProxyApp

VENTI = load_profile("venti", profile_dirs())
APP = ProxyApp(VENTI, get_engine("vllm"), "http://10.0.0.11:8100", None)


def client_message(text: str) -> str:
    error = EngineHTTPError(400, {"error": {"message": text}})
    return from_engine(error, APP.orch.engine_names, VENTI.served_model_name).message


@pytest.mark.parametrize(
    ("text", "leak"),
    [
        ("connect to fe80::1%eth0 failed", "fe80"),
        ("peer 2001:db8::8a2e:370:7334 reset the stream", "2001:db8"),
        ("bound to ::1 only", "::1"),
        ("kv peer 2001:0db8:85a3:0000:0000:8a2e:0370:7334 is gone", "85a3"),
        ("cannot reach engine-0.molctl.svc.cluster.local:8000", "cluster.local"),
        ("worker engine-1:8001 timed out", "engine-1"),
    ],
)
def test_ipv6_addresses_and_internal_host_names_are_scrubbed(text, leak):
    """Guards the leak: each passed the scrubber as it was."""
    message = client_message(text)
    assert leak not in message and "<address>" in message, message


@pytest.mark.parametrize(
    "text",
    [
        "queued at 05:39:42 for 3 s",
        "ratio 1.5:1 is not allowed",
        "'tool_choice' must be 'auto': got value:3",
    ],
)
def test_times_and_ratios_are_kept(text):
    """Guards the patterns' edges: a time or a ratio is no address."""
    assert client_message(text) == text
