"""The SGLang proxy stack: the scripted fake SGLang (tests/fake_sglang.py) and a venti-sglang proxy in
front of it, driven by the official `openai` SDK (`Stack`); `sglang_stack(keyfile, logs, ...)` gives
their context managers and the Stack. Used by tests/proxy/pipeline/ (test_proxy_sglang, test_hop_priority)."""

from __future__ import annotations

import httpx
import openai

from molctl.profiles import load_profile, profile_dirs
from tests.helpers import free_ports
from tests.procs import fake_sglang_argv, proxy_argv, running, sglang_health_request_timeout

KEY = "sk-test-sglang"
VENTI = load_profile("venti-sglang", profile_dirs())
PUBLIC = VENTI.served_model_name
SERVED = VENTI.engine.served_name


class Stack:
    def __init__(self, engine_url: str, proxy_url: str, key: str = KEY):
        self.engine_url, self.proxy_url = engine_url, proxy_url
        self.client = openai.OpenAI(base_url=proxy_url + "/v1", api_key=key, max_retries=0, timeout=30)

    def config(self, **cfg):
        httpx.post(self.engine_url + "/_config", json=cfg).raise_for_status()

    def reset(self):
        httpx.post(self.engine_url + "/_reset").raise_for_status()

    def log(self, hop: str | None = None) -> list[dict]:
        return [e for e in httpx.get(self.engine_url + "/_log").json() if hop is None or e["hop"] == hop]


def sglang_stack(keyfile, logs, *proxy_args: str, cache_report=True, key: str = KEY):
    """(engine, proxy) context managers and the Stack: the fake SGLang and a venti-sglang proxy
    started with `proxy_args` (the proxy's key file `keyfile`, holding `key`)."""
    engine_port, proxy_port = free_ports(2)
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    # /health answers 200 only after the fake's warm-up, as SGLang's
    return (
        running(
            fake_sglang_argv(engine_port, SERVED, cache_report=cache_report),
            engine_url + "/health",
            log=logs / f"engine-{engine_port}.log",
            ready_request_timeout=sglang_health_request_timeout(),
        ),
        running(
            proxy_argv("venti-sglang", engine_url, proxy_port, "--api-key-file", str(keyfile), *proxy_args),
            proxy_url + "/health",
            log=logs / f"proxy-{proxy_port}.log",
        ),
        Stack(engine_url, proxy_url, key),
    )
