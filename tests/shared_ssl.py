"""One SSL context per test process for httpx's default clients: a speed shim, installed by
tests/conftest.py in every pytest process.

httpx makes an SSL context for each Client, loading certifi's CA bundle (about 37 ms of CPU), and
`httpx.get`/`post`/`stream` make a Client per call: the readiness polls of tests/procs.py, the fake
engine's /_config, /_log and /_reset calls and the openai SDK's clients. Counted over
tests/proxy and tests/lifecycle, 2,484 contexts took 94 of the pytest workers' 175 CPU-seconds. With
this, a context is made once per (verify, trust_env) and shared, as molctl does by design for its own
calls (molctl/localhttp.py); a client given its own context or a client certificate is untouched.
The hook is httpx's own name (httpx/_transports/default.py imports create_ssl_context from
httpx/_config.py): if a later httpx moves it, `install` fails at the suite's start, not silently."""

from __future__ import annotations

import functools

import httpx._transports.default as _transport

_make = _transport.create_ssl_context


@functools.lru_cache(maxsize=4)
def _shared(verify: bool, trust_env: bool):
    return _make(verify=verify, cert=None, trust_env=trust_env)


def _ssl_context(verify=True, cert=None, trust_env=True, **more):
    if isinstance(verify, bool) and cert is None and not more:
        return _shared(verify, trust_env)
    return _make(verify=verify, cert=cert, trust_env=trust_env, **more)


def install() -> None:
    _transport.create_ssl_context = _ssl_context
