"""Helpers of the Redis store tests (tests/proxy/store/): the key prefix `P` of the tiny profile,
`state(redis)` (a RedisState on a test server), `Clock` (wall time that moves a millisecond a call),
`totals_agree(r)` (the store's byte and count totals against what is stored), and
`shared_profile(tmp_path, url)` with `SKIP_ALL_BUT_STATE` for `molctl check` / `state` on Redis, and
`until_served(call)`, a client call retried through the store's 503s, and `PATIENT_STORE`."""

from __future__ import annotations

import time
from pathlib import Path

from molctl.proxy.store.redis.connection import RedisState
from molctl.proxy.store.redis.target import parse_redis_url
from tests.helpers import ROOT

P = "molctl:{tiny}:"


# for a proxy process on Redis in a test that is not about the store's timeouts: a loaded host can
# outrun the default proxy.store_call_timeout_s (0.5 s) and degrade the store mid-test (RETRY_S)
PATIENT_STORE = ("--set", "proxy.store_call_timeout_s=5")


def until_served(call, within_s: float = 10):
    """call() (an `openai` client's request to a proxy) until it is not a 503, within_s at most: a
    store still read-only, or degraded for RETRY_S by a call past its 0.5 s timeout on a loaded host
    (a first call also connects and loads the scripts)."""
    import openai

    deadline = time.monotonic() + within_s
    while True:
        try:
            return call()
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and time.monotonic() < deadline, exc
            time.sleep(0.1)


def state(redis, clock=None, **kw) -> RedisState:
    return RedisState(
        parse_redis_url(redis.url),
        None,
        "tiny",
        replica_id=kw.pop("replica_id", "a"),
        advertise_upstream="http://engine-a",
        clock=clock or time.time,
        **kw,
    )


class Clock:
    """Wall time that moves a millisecond a call: every write has its own index score."""

    def __init__(self, t: float | None = None):
        self.t = time.time() if t is None else t

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def totals_agree(r) -> dict[str, tuple[int, int]]:
    """The script's totals against what is stored: per tenant (responses, bytes) and overall; every
    accounted key exists (or expired), every index agrees. Returns the per-tenant totals."""
    sizes = {k.decode(): v.decode() for k, v in r.hgetall(P + "rsz").items()}
    per: dict[str, list[int]] = {}
    for key, meta in sizes.items():
        size, tenant = meta.split(":", 1)
        assert r.strlen(key) == int(size), key
        assert r.zscore(P + "idx:rt:" + tenant, key) is not None and r.zscore(P + "idx:r", key) is not None
        per.setdefault(tenant, [0, 0])
        per[tenant][0] += 1
        per[tenant][1] += int(size)
    # key format 3: each chain's bytes counted once against its tenant; its references and length agree
    links = {k.decode(): v.decode().split(":", 1) for k, v in r.hgetall(P + "rch").items()}
    meta = {k.decode(): int(v) for k, v in r.hgetall(P + "chm").items()}
    chains: dict[str, list[str]] = {}
    for key, (count, cid) in links.items():
        assert key in sizes and r.llen(P + "ch:" + cid) >= int(count), key
        chains.setdefault(cid, []).append(key)
    for cid, keys in chains.items():
        items = r.lrange(P + "ch:" + cid, 0, -1)
        assert (
            meta["r:" + cid] == len(keys)
            and meta["l:" + cid] == len(items)
            and meta["b:" + cid] == sum(map(len, items))
        )
        per[sizes[keys[0]].split(":", 1)[1]][1] += meta["b:" + cid]
    assert set(meta) == {f"{f}:{cid}" for cid in chains for f in "rlb"}
    assert {t.decode(): int(n) for t, n in r.zrange(P + "tn", 0, -1, withscores=True)} == {
        t: v[0] for t, v in per.items()
    }
    assert {t.decode(): int(b) for t, b in r.zrange(P + "tb", 0, -1, withscores=True)} == {
        t: v[1] for t, v in per.items()
    }
    assert int(r.hget(P + "stats", "r_bytes") or 0) == sum(v[1] for v in per.values())
    for tenant, (n, _) in per.items():
        assert r.zcard(P + "idx:rt:" + tenant) == n
    return {t: (v[0], v[1]) for t, v in per.items()}


SKIP_ALL_BUT_STATE = [
    a for c in ("engine", "gpu", "model", "adapter", "template", "port", "security") for a in ("--skip", c)
]


def shared_profile(tmp_path, store_url: str) -> Path:
    """A profile `shared`: tiny with proxy.store on Redis (state stats|prune read the profile as it is)."""
    d = tmp_path / "profiles"
    d.mkdir(parents=True)
    text = (ROOT / "profiles" / "tiny.yaml").read_text().replace("name: tiny", "name: shared", 1)
    (d / "shared.yaml").write_text(text.replace("proxy:\n", f"proxy:\n  store: {store_url}\n", 1))
    return d
