"""HTTP polls of a starting or running stack (httpx; the CLI's polls are not on a hot path).

Engine readiness, for vLLM and SGLang alike: `/health` 200, then `/v1/models` lists L0-L3 with
the profile's engine-side base name as parent, then (engines that report it: SGLang) the running
server's version matches the pin, then a 1-token completion per adapter succeeds (an adapter can
load and still do nothing: vllm#55193). `/health` 200 alone proves neither. What differs between
the engines (what a non-200 /health means, how /v1/models lists adapters, the smoke request, the
version endpoint) are hooks of the engine module (`molctl.engines.base.Engine`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import httpx

from molctl import localhttp
from molctl.engines.base import Engine, adapter_problems
from molctl.profiles import Profile
from molctl.routes import ROUTES


def connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def base_url(host: str, port: int) -> str:
    """`http://HOST:PORT` to connect to a server listening on host:port (IPv6 bracketed,
    a wildcard listen address reached through loopback)."""
    host = connect_host(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def engine_url(profile: Profile) -> str:
    return base_url(profile.engine.host, profile.engine.port)


def proxy_url(profile: Profile) -> str:
    return base_url(profile.proxy.host, profile.proxy.port)


@dataclass
class Poll:
    """The outcome of one readiness poll."""

    state: str  # "down" | "starting" | "adapters" | "version" | "ready"
    detail: str


class EngineReadiness:
    def __init__(self, profile: Profile, engine: Engine, client: httpx.Client | None = None, url: str | None = None):
        self.profile, self.engine = profile, engine
        self.url = url or engine_url(profile)
        self.client = client or localhttp.client(timeout=httpx.Timeout(5.0, connect=1.0))
        self.smoke_ok: set[str] = set()
        self.version_ok = False

    def poll(self) -> Poll:
        try:
            r = self.client.get(self.url + "/health", timeout=3.0)
        except httpx.HTTPError:
            return Poll("down", "not listening yet")
        if r.status_code != 200:
            return Poll("starting", self.engine.health_detail(r.status_code))
        try:
            models = self.client.get(self.url + "/v1/models").json()
        except (httpx.HTTPError, ValueError):
            return Poll("starting", "/v1/models not answering")
        problems = adapter_problems(self.profile, self.engine, models)
        if problems:
            return Poll("adapters", "; ".join(problems))
        if self.engine.version_path and not self.version_ok:
            try:
                r = self.client.get(self.url + self.engine.version_path)
                if r.status_code == 404 and self.engine.version_fallback_path:
                    r = self.client.get(self.url + self.engine.version_fallback_path)
                body = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return Poll("starting", f"{self.engine.version_path} not answering")
            if body is None:
                return Poll("starting", f"{self.engine.version_path} answered {r.status_code}")
            problem = self.engine.version_problem(self.profile, self.engine.running_version(body))
            if problem:
                return Poll("version", problem)
            self.version_ok = True
        for route in ROUTES:
            if route in self.smoke_ok:
                continue
            body = self.engine.smoke_request(self.profile, route)
            try:
                r = self.client.post(
                    self.url + "/v1/chat/completions", json=body, headers={"X-MoL-Hop": "readiness"}, timeout=60.0
                )
            except httpx.HTTPError as exc:
                return Poll("starting", f"1-token completion on {route} failed: {type(exc).__name__}")
            if r.status_code in (400, 404, 422):  # refused, not busy: waiting changes nothing
                return Poll("adapters", f"1-token completion on {route} answered {r.status_code}: {_message(r)}")
            if r.status_code != 200:
                return Poll("starting", f"1-token completion on {route} answered {r.status_code}")
            self.smoke_ok.add(route)
        return Poll("ready", "health, adapters and a 1-token completion per adapter")


def _message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text[:200]
    err = body.get("error", body) if isinstance(body, dict) else body
    msg = err.get("message") if isinstance(err, dict) else None
    return " ".join(str(msg if msg is not None else body).split())[:200]


POLL_S = 0.5  # "about once a second" or better: a refused connect costs nothing


class Poller(Protocol):
    def poll(self) -> Poll: ...


def wait_ready(
    readiness: Poller,
    timeout_s: float,
    *,
    check_alive: Callable[[], None],
    on_wait: Callable[[float, Poll], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = POLL_S,
) -> tuple[Poll, float]:
    """Poll until the engine is ready, its adapters or version are wrong, or `timeout_s` passed;
    returns the last poll (state "ready", "adapters", "version", or anything else: timed out)
    and the seconds waited.
    `check_alive()` runs before every poll (it raises when a watched process exited);
    `on_wait(elapsed, poll)` after every poll that is not final."""
    start = clock()
    deadline = start + timeout_s
    while True:
        check_alive()
        probe = readiness.poll()
        if probe.state in ("ready", "adapters", "version"):
            return probe, clock() - start
        now = clock()
        if now >= deadline:
            return probe, now - start
        on_wait(now - start, probe)
        sleep(min(poll_s, max(0.05, deadline - now)))


def http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        return localhttp.get(url, timeout=timeout).status_code
    except httpx.HTTPError:
        return None
