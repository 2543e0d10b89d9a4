"""The shared backend of the proxy's state: Redis (or Valkey), for N proxy replicas behind one
load balancer (`proxy.store: redis://host:port/db`, `rediss://` for TLS).

One `RedisState` per proxy process holds the connection (redis-py asyncio: every call is
awaited on the event loop, none blocks it) and serves three views of it:
  - `RedisResponseStore`: the Responses API's records (the `ResponseStore` protocol, async);
  - `RedisConversationStore`: stateless chat's turns and tool-call bindings (the sync
    `ConversationStore` protocol over a local `MemoryStore`, plus `load` / `flush`, awaited by
    the orchestrator once per request: see below);
  - the replica registry: `register()` / `engine_for(owner)` (conversation affinity).

Connection and secrets. The URL may name a user but never a password (refused with one line
naming proxy.store); the password comes from `proxy.store_password_file` or the environment
variable MOLCTL_STORE_PASSWORD (never argv). Logs show `address` (scheme://host:port/db).

Keys (all hash-tagged by profile, so one profile's keys share a Cluster slot; Cluster itself is
not a target): PREFIX = `molctl:{PROFILE}:`
  - `r:TENANT:RESP_ID`   a response record (JSON), TTL proxy.store_ttl_s; preceded by the store
                          keys its chain's next request reads ("t:HEX c:TENANT:ID ..." and a newline), so that
                          one script (GET_CHAIN) returns the record and their values;
  - `t:HEX(KEY)`         a chat turn {route, summary, state, replica, at} (the key is already
                          seeded with the tenant), TTL as above;
  - `c:TENANT:CALL_ID`   a tool-call binding {route, arguments, name, replica}, TTL as above;
  - `replica:ID`         a replica's heartbeat {upstream, at}, TTL HEARTBEAT_TTL_S;
  - `idx:r`, `idx:conv`  sorted sets (member: key, score: write time) for the count caps;
  - `idx:rt:TENANT`, `rsz`, `tb`, `tn`  the Responses records per tenant (key format 2, RESPONSES):
                          the tenant's index, each record's size and tenant, bytes and count per tenant;
  - `ch:CID`, `rch`, `chm`  a chain's messages (a list, one JSON message an element; TTL refreshed by
                          each write of the chain), each response's link to it, and per chain its
                          references, length and bytes (key format 3, PUT_RESPONSE);
  - `stats`              a hash of evicted counts, the records' bytes (r_bytes) and the key format.

Bounded memory: every record key has a TTL (Redis drops it itself). A Responses write (one script,
RESPONSES) forgets expired index entries, then a tenant (API key) over its quota
(`proxy.store_tenant_max_entries` / `_bytes`, by default a quarter of the global caps) evicts its
own oldest, and as a last resort a store over `proxy.store_max_entries` / `store_max_bytes` evicts
from the tenant holding the most (records of key format 1 first); never the record being written;
a record over a byte cap on its own is refused before the write (QuotaExceeded: a 400). A chain's
shared history is stored once (key format 3): a continuation of its chain's newest response appends
only its new messages (RPUSH, in the script that writes the record); a branch starts a chain of its
own with its whole conversation; a read gets the record and LRANGE of its messages in one script
(GET_CHAIN); a chain's list stays while a response references it, and its bytes count once against
the tenant. Format-1 and -2 records (holding their own conversation) are still read. Chat state:
past `proxy.store_max_entries`, the oldest keys of its group go (at most EVICT_BATCH per write).
Configure Redis with `maxmemory` and `maxmemory-policy volatile-lru` (every molctl record key
has a TTL, so Redis may evict them under pressure; an evicted record is simply unknown, as in
SQLite; its accounting stays until its index entry expires or is evicted).

Races between replicas. Responses records and call bindings are written once under unique ids.
A turn key names one history plus its answer, so a later turn never shares a key with an
earlier one; what can race on one key is the same turn's state: "pending" (just answered),
"summary"/"failed" (the summary hop ended), "stale" (another replica folded the turn without its
summary, so it must stay without one). A Lua script merges them atomically by rank (pending <
summary|failed < stale): a write never lowers a turn's rank, and a summary arriving after a
stale mark is dropped; the writer learns the merged state. Scripts use Redis 6.2 commands only
(EVALSHA, SET EX, ZADD, ZRANGE by index, ZREMRANGEBYSCORE, cjson).

Cost (bench/bench_redis.py, BENCHMARKS.md): a call is one round trip, ~0.1-0.25 ms on the 2-core
dev host; writes started in one turn of the event loop go out in one pipeline (`_write`), so
concurrent requests share round trips. Per request: a chained Responses request makes two (the
previous response with its conversation's turns and tool calls: `get_previous`; the new turn and
response written together), a chat turn with history two (MGET, write), a first turn one.

Failure behaviour. Every call runs under `call_timeout_s` (which bounds the connect, the send
and the reads; one reconnect on a dropped connection, none on a timeout). A call sends its
commands on one pooled redis-py connection and reads their raw replies (`_exchange`); a
connection left with a reply half-read (a timeout, a cancelled call) is disconnected, never pooled.
A failure marks the store degraded (logged once, counted in `degraded_total`, `errors_total`);
while degraded, calls fail at once for RETRY_S, then one call tries again, and the first
success recovers (logged once): a stuck or lost Redis costs a request at most one timeout,
and nothing needs a restart. An error the server answers (OOM, ACL, READONLY) fails that call
only (`refused`: not degraded; READONLY also reconnects). Chat keeps answering from the local cache (folds of turns this
process did not see are lost for the while); Responses requests that need state get a 503 with
Retry-After (`StoreUnavailable`)."""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from molctl.errors import MolctlError, UsageError
from molctl.proxy import fastjson
from molctl.proxy.conversations import CallBinding, MemoryStore, TurnRecord
from molctl.proxy.engine_client import ENGINE, EngineChoice
from molctl.proxy.errors import ProxyError
from molctl.proxy.response_store import DEFAULT_TTL_S, ResponseRecord
from molctl.proxy.sqlite_store import DEFAULT_MAX_BYTES, QuotaExceeded

log = logging.getLogger("molctl.proxy")

PASSWORD_ENV = "MOLCTL_STORE_PASSWORD"
CALL_TIMEOUT_S = 0.5  # one store call, round trip included (socket timeouts alike)
CONNECT_TIMEOUT_S = 1.0
RETRY_S = 1.0  # while degraded, calls fail at once for this long, then one tries again
HEARTBEAT_S = 2.0  # a replica refreshes its registration this often...
HEARTBEAT_TTL_S = 6.0  # ...and it lapses this long after the last refresh
EVICT_BATCH = 64
EVICT_MAX = 1024  # a response write evicts at most this many (a large record over a byte quota of small ones)
EXPIRE_BATCH = 256  # expired index entries a response write forgets (the rest: the next writes, or a prune)
KEY_FORMAT = (
    3  # 1: one count cap per group; 2: + per-tenant quotas and byte totals; 3: + chains (`stats` field "format")
)
TENANT_SHARE = 4  # a tenant's default quota: a quarter of each global cap (as the SQLite store's)
MAX_CONNECTIONS = 64  # per proxy process
RETRY_AFTER_S = "2"
REFUSED_LOG_S = 60.0  # an error the server answers (OOM, NOPERM) is logged at most this often per kind

# KEYS[1] record, KEYS[2] index, KEYS[3] stats; ARGV: value, ttl_s, now, max_entries, stats field
PUT_CAPPED = """
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return trim(KEYS[1], KEYS[2], KEYS[3], ARGV)
"""
TRIM = """
local function trim(key, idx, stats, a)
  local now, ttl, cap = tonumber(a[3]), tonumber(a[2]), tonumber(a[4])
  redis.call('ZADD', idx, now, key)
  redis.call('ZREMRANGEBYSCORE', idx, '-inf', now - ttl)
  local over = redis.call('ZCARD', idx) - cap
  if over <= 0 then return 0 end
  if over > EVICT_BATCH then over = EVICT_BATCH end
  -- one more than needed: the key being written is never its own write's victim (a replica whose
  -- clock stepped back or lags its peers writes the lowest score)
  local victims, n = redis.call('ZRANGE', idx, 0, over), 0
  for _, v in ipairs(victims) do
    if n < over and v ~= key then redis.call('DEL', v); redis.call('ZREM', idx, v); n = n + 1 end
  end
  redis.call('HINCRBY', stats, a[5], n)
  return n
end
""".replace("EVICT_BATCH", str(EVICT_BATCH))
# a turn: never lower its rank (pending 0 < summary|failed 1 < stale 2); returns the stored JSON. A
# stored value that is no turn (unreadable: another version's, a hand edit) is replaced.
MERGE_TURN = """
local new = cjson.decode(ARGV[1])
local old_raw = redis.call('GET', KEYS[1])
local rank = {pending = 0, summary = 1, failed = 1, stale = 2}
local out = new
local ok, old = false, nil
if old_raw then ok, old = pcall(cjson.decode, old_raw) end
if ok and type(old) == 'table' and rank[old.state] and type(old.route) == 'string' then
  if rank[new.state] > rank[old.state] then
    out.replica, out.route = old.replica, old.route
  else
    out = old
  end
end
local raw = cjson.encode(out)
redis.call('SET', KEYS[1], raw, 'EX', ARGV[2])
trim(KEYS[1], KEYS[2], KEYS[3], ARGV)
return raw
"""


# the write tasks of the current request (set by RedisConversationStore.load): `flush` waits for these only
_REQUEST_WRITES: contextvars.ContextVar[list[asyncio.Future] | None] = contextvars.ContextVar(
    "molctl_store_writes", default=None
)


class _RequestReads:
    """One request's reads (a contextvar: uvicorn runs each request in a task of its own).
    `prefetched`: store keys (without the prefix) read together with the previous response
    (value None: absent), used once by the next `load`; `names`: the store keys the next request
    of this conversation will read (the history's turns, this answer's turn or tool calls), kept
    with the response this request stores."""

    __slots__ = ("names", "prefetched")

    def __init__(self, prefetched: dict[str, bytes | None] | None = None):
        self.prefetched = prefetched
        self.names: list[str] = []


_REQUEST_READS: contextvars.ContextVar[_RequestReads | None] = contextvars.ContextVar(
    "molctl_store_reads", default=None
)
_NAME_SPACES = frozenset(b" \t\n\r\x0b\x0c")  # what the chain script splits names on


def _keep_name(name: str) -> None:
    """Remember a store key the next request of this conversation reads (see _RequestReads)."""
    reads = _REQUEST_READS.get()
    if reads is not None and not _NAME_SPACES.intersection(name.encode()):
        reads.names.append(name)


def _decode(raw: bytes, **fields: type | tuple[type, ...]) -> dict[str, Any] | None:
    """A stored JSON object whose `fields` have these types, else None: an unreadable value (written
    by another molctl version, a hand edit, another program) is treated as absent, never a crash."""
    try:
        data = fastjson.loads(raw)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return None
    if not isinstance(data, dict) or any(not isinstance(data.get(k), t) for k, t in fields.items()):
        return None
    return data


def _record_json(raw: bytes) -> bytes:
    """A stored response's JSON (without the store keys kept before it: see GET_CHAIN)."""
    newline = raw.find(b"\n")
    return raw if raw[:1] == b"{" or newline < 0 else raw[newline + 1 :]


# a response record and, in one round trip, the store keys its next request reads (see
# RedisResponseStore.get_previous): the record's value is "NAME NAME ...\n" + JSON when the names
# were kept with it (JSON never holds a raw newline), plain JSON otherwise. KEYS[1] the record;
# ARGV[1] the key prefix. Returns {record or nil, value of each name (nil: absent)...}. The names
# are keys of the same profile (one hash tag, one Cluster slot), as TRIM's victims are.
# Key format 3: the reply's second element is the record's conversation from its chain,
# {COUNT, message...} (fewer than COUNT messages: the chain's list was lost, e.g. evicted by Redis's
# maxmemory policy), or false for a record holding its own (format 1 and 2).
GET_CHAIN = """
local raw = redis.call('GET', KEYS[1])
if not raw then return {false} end
local out = {raw, false}
local l = redis.call('HGET', ARGV[1] .. 'rch', KEYS[1])
if l then
  local n, cid = string.match(l, '^(%d+):(.*)$')
  n = tonumber(n)
  local msgs = {n}
  if n > 0 then
    for _, m in ipairs(redis.call('LRANGE', ARGV[1] .. 'ch:' .. cid, 0, n - 1)) do msgs[#msgs + 1] = m end
  end
  out[2] = msgs
end
if string.byte(raw, 1) == 123 then return out end
local nl = string.find(raw, '\\n', 1, true)
if not nl then return out end
local names = {}
for name in string.gmatch(string.sub(raw, 1, nl - 1), '%S+') do names[#names + 1] = ARGV[1] .. name end
for i = 1, #names, 500 do
  local values = redis.call('MGET', unpack(names, i, math.min(i + 499, #names)))
  for j = 1, #values do out[#out + 1] = values[j] end
end
return out
"""


# Responses under per-tenant quotas (key format 2, issue 32), shared by the put, the delete and a
# prune. Per response key K (`r:TENANT:ID`): its entry in `idx:r` (all tenants, by write time: the
# global count), in `idx:rt:TENANT` (the tenant's, by write time) and in the hash `rsz` ("SIZE:TENANT",
# SIZE the stored value's bytes); per tenant its bytes and its count in the sorted sets `tb` and `tn`
# (the biggest tenant at the top); the global bytes in `stats` field r_bytes. An entry of `idx:r`
# without an `rsz` field was written by key format 1 (no quotas): it is read as before, counts
# towards the global count only and is the first victim of the global cap. Everything a write
# changes is changed by its one script: replicas sharing the Redis always agree on the totals.
RESPONSES = """
local P = ARGV[1]
local IDX, STATS, RSZ, TB, TN = P .. 'idx:r', P .. 'stats', P .. 'rsz', P .. 'tb', P .. 'tn'
local RCH, CHM = P .. 'rch', P .. 'chm'
local function tidx(tenant) return P .. 'idx:rt:' .. tenant end
-- a response's chain reference (key format 3): {messages it holds, chain id} or nil
local function link(key)
  local l = redis.call('HGET', RCH, key)
  if not l then return nil end
  local n, cid = string.match(l, '^(%d+):(.*)$')
  return {tonumber(n), cid}
end
-- one reference of a chain less; the bytes freed (the chain's own when that was its last reference)
local function unref(cid)
  if redis.call('HINCRBY', CHM, 'r:' .. cid, -1) > 0 then return 0 end
  local bytes = tonumber(redis.call('HGET', CHM, 'b:' .. cid) or 0)
  redis.call('HDEL', CHM, 'r:' .. cid, 'l:' .. cid, 'b:' .. cid)
  redis.call('DEL', P .. 'ch:' .. cid)
  return bytes
end
-- drop a response key and its accounting (returns 1 when the key still existed); its chain's
-- messages stay while another response references the chain
local function forget(key)
  local gone = redis.call('DEL', key)
  redis.call('ZREM', IDX, key)
  local meta = redis.call('HGET', RSZ, key)
  if meta then
    local size, tenant = string.match(meta, '^(%d+):(.*)$')
    size = tonumber(size)
    local l = link(key)
    if l then
      redis.call('HDEL', RCH, key)
      size = size + unref(l[2])
    end
    redis.call('HDEL', RSZ, key)
    redis.call('ZREM', tidx(tenant), key)
    redis.call('HINCRBY', STATS, 'r_bytes', -size)
    redis.call('ZINCRBY', TB, -size, tenant)
    if tonumber(redis.call('ZINCRBY', TN, -1, tenant)) <= 0 then
      redis.call('ZREM', TN, tenant)
      redis.call('ZREM', TB, tenant)
    end
  end
  return gone
end
-- index entries older than the TTL (their keys expired already, or do now): at most `limit`
local function expire(idx, cutoff, limit)
  local old = redis.call('ZRANGEBYSCORE', idx, '-inf', '(' .. cutoff, 'LIMIT', 0, limit)
  for _, key in ipairs(old) do
    forget(key)
    redis.call('ZREM', idx, key)  -- a tenant index's entry whose accounting is gone already
  end
  return #old
end
-- the oldest response of a tenant but `keep` (nil: none left)
local function oldest(tenant, keep)
  for _, key in ipairs(redis.call('ZRANGE', tidx(tenant), 0, 1)) do
    if key ~= keep then return key end
  end
  return nil
end
local function tenant_over(tenant, max_entries, max_bytes)
  local n = tonumber(redis.call('ZSCORE', TN, tenant) or 0)
  local b = tonumber(redis.call('ZSCORE', TB, tenant) or 0)
  return n > max_entries or b > max_bytes
end
-- a tenant over its quota evicts its own oldest; returns how many
local function evict_tenant(tenant, keep, max_entries, max_bytes, limit)
  local n = 0
  while n < limit and tenant_over(tenant, max_entries, max_bytes) do
    local victim = oldest(tenant, keep)
    if not victim then break end
    forget(victim)
    n = n + 1
  end
  return n
end
-- over a global cap (the last resort): a key format 1 entry at the head of the index first, else
-- the oldest of the tenant holding the most (bytes or responses, whichever cap is exceeded)
local function evict_global(keep, max_entries, max_bytes, limit)
  local n = 0
  while n < limit do
    local by_bytes = tonumber(redis.call('HGET', STATS, 'r_bytes') or 0) > max_bytes
    if not by_bytes and redis.call('ZCARD', IDX) <= max_entries then break end
    local victim = nil
    for _, key in ipairs(redis.call('ZRANGE', IDX, 0, 1)) do
      if key ~= keep and redis.call('HEXISTS', RSZ, key) == 0 then victim = key; break end
    end
    if not victim then
      for _, tenant in ipairs(redis.call('ZREVRANGE', by_bytes and TB or TN, 0, 1)) do
        victim = oldest(tenant, keep)
        if victim then break end
      end
    end
    if not victim then break end
    forget(victim)
    n = n + 1
  end
  return n
end
"""
# KEYS[1] the record; ARGV: prefix, value, ttl_s, now, tenant, max_entries, max_bytes,
# tenant_max_entries, tenant_max_bytes, the key of the response it continues ('' none), then each
# message of its whole conversation (JSON). Returns how many responses it evicted.
# Chains (key format 3): a response continuing the newest response of its chain (the one holding
# the chain's length in messages) appends only its new messages to the chain's list `ch:CID`
# (RPUSH); any other (a first response, a branch, a continuation of a format-2 record) starts a
# chain of its own with its whole conversation. `rch` (response key -> "COUNT:CID") links a response
# to its first COUNT messages; `chm` holds per chain its references (r:CID), length (l:CID) and
# bytes (b:CID, counted once against the tenant, in `tb` and r_bytes). The list's TTL is refreshed by
# each write of the chain (so it outlives its responses); it goes with its last reference. Unlike
# SQLite's, a chain is never shortened: after its newest response goes, a continuation of an earlier
# one is a branch (its messages past the rest stay counted until the chain goes). A list shorter than
# its chain's length (Redis evicted it under maxmemory) is never continued; its responses read as unknown.
PUT_RESPONSE = (
    """
local key, value, ttl, now, tenant = KEYS[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local max_entries, max_bytes = tonumber(ARGV[6]), tonumber(ARGV[7])
local tmax_entries, tmax_bytes = tonumber(ARGV[8]), tonumber(ARGV[9])
local prev, first, nmsg = ARGV[10], 11, #ARGV - 10
-- first a write Redis refuses at maxmemory (noeviction): the whole script is then refused, nothing
-- changed (once a script has written, e.g. a DEL, Redis lets its later writes through over maxmemory)
redis.call('HSET', STATS, 'format', KEY_FORMAT)
forget(key)  -- the same id written again: its old value's bytes go
expire(IDX, now - ttl, EXPIRE_BATCH)
expire(tidx(tenant), now - ttl, EXPIRE_BATCH)
local cid, base = nil, 0
if prev ~= '' and redis.call('EXISTS', prev) == 1 then
  local l = link(prev)
  if l and l[1] <= nmsg and tonumber(redis.call('HGET', CHM, 'l:' .. l[2]) or -1) == l[1]
     and redis.call('LLEN', P .. 'ch:' .. l[2]) == l[1] then
    cid, base = l[2], l[1]
  end
end
if not cid then cid = tostring(redis.call('HINCRBY', STATS, 'chain_seq', 1)) end
local ckey, added = P .. 'ch:' .. cid, 0
for i = first + base, #ARGV, 256 do
  local stop = math.min(i + 255, #ARGV)
  redis.call('RPUSH', ckey, unpack(ARGV, i, stop))
  for j = i, stop do added = added + #ARGV[j] end
end
if redis.call('TTL', ckey) < ttl and redis.call('EXISTS', ckey) == 1 then redis.call('EXPIRE', ckey, ttl) end
redis.call('HINCRBY', CHM, 'r:' .. cid, 1)
redis.call('HSET', CHM, 'l:' .. cid, nmsg)
redis.call('HINCRBY', CHM, 'b:' .. cid, added)
redis.call('HSET', RCH, key, nmsg .. ':' .. cid)
redis.call('SET', key, value, 'EX', ttl)
redis.call('ZADD', IDX, now, key)
redis.call('ZADD', tidx(tenant), now, key)
redis.call('HSET', RSZ, key, #value .. ':' .. tenant)
redis.call('HINCRBY', STATS, 'r_bytes', #value + added)
redis.call('ZINCRBY', TB, #value + added, tenant)
redis.call('ZINCRBY', TN, 1, tenant)
local n = evict_tenant(tenant, key, tmax_entries, tmax_bytes, EVICT_MAX)
n = n + evict_global(key, max_entries, max_bytes, EVICT_MAX - n)
if n > 0 then redis.call('HINCRBY', STATS, 'r_evicted', n) end
return n
""".replace("EXPIRE_BATCH", str(EXPIRE_BATCH))
    .replace("EVICT_MAX", str(EVICT_MAX))
    .replace("KEY_FORMAT", str(KEY_FORMAT))
)
# KEYS[1] the record; ARGV[1] prefix. 1 when it existed.
DELETE_RESPONSE = """
return forget(KEYS[1])
"""
# `molctl state prune` (ARGV: prefix, now, ttl_s, max_entries, max_bytes, tenant_max_entries,
# tenant_max_bytes, limit): {expired, evicted, more (1: call again)}
PRUNE_BATCH = 1000  # a prune's script call removes at most this many (then it is called again)
PRUNE_RESPONSES = """
local now, ttl, limit = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[8])
local max_entries, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5])
local tmax_entries, tmax_bytes = tonumber(ARGV[6]), tonumber(ARGV[7])
local expired = expire(IDX, now - ttl, limit)
local evicted = 0
if expired < limit then
  local tenants = {}
  for _, t in ipairs(redis.call('ZRANGEBYSCORE', TN, '(' .. tmax_entries, '+inf')) do tenants[t] = true end
  for _, t in ipairs(redis.call('ZRANGEBYSCORE', TB, '(' .. tmax_bytes, '+inf')) do tenants[t] = true end
  for t in pairs(tenants) do
    if evicted < limit then evicted = evicted + evict_tenant(t, nil, tmax_entries, tmax_bytes, limit - evicted) end
  end
  evicted = evicted + evict_global(nil, max_entries, max_bytes, limit - evicted)
  if evicted > 0 then redis.call('HINCRBY', STATS, 'r_evicted', evicted) end
end
return {expired, evicted, (expired + evicted >= limit) and 1 or 0}
"""


SCRIPTS = {
    "put": TRIM + PUT_CAPPED,
    "turn": TRIM + MERGE_TURN,
    "chain": GET_CHAIN,
    "rput": RESPONSES + PUT_RESPONSE,
    "rdel": RESPONSES + DELETE_RESPONSE,
}
SCRIPT_SHA: dict[str, str] = {}


class StoreUnavailable(ProxyError):
    """The shared store cannot be reached: a 503 with Retry-After for requests that need state."""

    def __init__(self, why: str = ""):
        super().__init__(
            503,
            "The proxy's state store is unavailable; retry shortly.",
            "server_error",
            "store_unavailable",
            headers={"retry-after": RETRY_AFTER_S},
        )
        self.why = why


class RedisConfigError(MolctlError):
    """proxy.store names Redis but cannot be used (one line naming proxy.store)."""


@dataclass(frozen=True)
class RedisTarget:
    url: str  # as given (never holds a password)
    host: str
    port: int
    db: int
    tls: bool
    username: str | None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal, as in a URL
        return f"{'rediss' if self.tls else 'redis'}://{host}:{self.port}/{self.db}"


def is_redis_spec(spec: str) -> bool:
    return spec.startswith(("redis://", "rediss://"))


def parse_redis_url(spec: str) -> RedisTarget:
    """ValueError (one line, what was expected) for anything but redis[s]://[user@]host[:port][/db]
    (port 1-65535, db an ASCII number; an explicit port 0 is refused, not read as the default)."""
    expected = "expected redis://host:port/db or rediss://host:port/db"
    try:
        parts = urlsplit(spec)
        parts.hostname  # noqa: B018 - raises ValueError for a malformed IPv6 literal ("[::1")
    except ValueError as exc:
        shown = spec.split("://", 1)[0]  # never the rest: it may hold a user part (a mistyped password)
        raise ValueError(f"{shown}://...: {exc} ({expected})") from None
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"{spec!r}: {expected}")
    if parts.password is not None:
        raise ValueError(
            "the URL holds a password: put it in proxy.store_password_file or the environment "
            f"variable {PASSWORD_ENV}, never in the URL"
        )
    if not parts.hostname:
        raise ValueError(f"{parts.scheme}://...: no host (expected {parts.scheme}://host:port/db)")
    host_port = parts.netloc.rpartition("@")[2]  # never the user part in a message: it may be a mistyped password
    try:
        port = 6379 if parts.port is None else parts.port
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise ValueError(f"{parts.scheme}://{host_port}: the port is not a number from 1 to 65535")
    path = parts.path.strip("/")
    if path and not (path.isascii() and path.isdigit()):
        raise ValueError(f"{parts.scheme}://{parts.hostname}:{port}/{path}: the database must be a number (e.g. /0)")
    if parts.query or parts.fragment:
        raise ValueError(f"{parts.scheme}://{parts.hostname}:{port}/{path}: no query or fragment expected")
    return RedisTarget(
        spec,
        parts.hostname,
        port,
        int(path or 0),
        parts.scheme == "rediss",
        unquote(parts.username) if parts.username else None,
    )


def read_password(password_file: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The store password: proxy.store_password_file (first line), else $MOLCTL_STORE_PASSWORD, else None."""
    env = os.environ if environ is None else environ
    if password_file:
        try:
            text = Path(password_file).expanduser().read_text()
        except OSError as exc:
            raise RedisConfigError(
                f"proxy.store_password_file {password_file}: cannot read it ({exc.strerror or exc})"
            ) from None
        first = text.strip().splitlines()[0].strip() if text.strip() else ""
        if not first:
            raise RedisConfigError(
                f"proxy.store_password_file {password_file}: empty (expected the password on its first line)"
            )
        return first
    return env.get(PASSWORD_ENV) or None


def default_replica_id(port: int) -> str:
    return f"{socket.gethostname()}:{port}"


MAX_REPLICA_ID = 200


def check_replica_id(replica_id: str) -> str:
    """The id as given, else a UsageError (one line, exit 2): 1 to MAX_REPLICA_ID printable
    characters without whitespace. It is copied into every turn and tool-call binding, named in
    log lines and keys (a newline would forge a log line; a blank or spaced id is a templating slip)."""
    if (
        not 0 < len(replica_id) <= MAX_REPLICA_ID
        or not replica_id.isprintable()
        or any(c.isspace() for c in replica_id)
    ):
        shown = replica_id if len(replica_id) <= 40 else replica_id[:40] + "..."
        raise UsageError(
            f"--replica-id {shown!r}: expected 1 to {MAX_REPLICA_ID} printable characters without "
            "whitespace (e.g. the pod or host name)"
        )
    return replica_id


def _client_kwargs(target: RedisTarget, password: str | None) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "host": target.host,
        "port": target.port,
        "db": target.db,
        "username": target.username,
        "password": password,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": CALL_TIMEOUT_S,
        "decode_responses": False,
        "health_check_interval": 0,
    }
    if target.tls:
        kw["ssl"] = True
    return kw


def ping_sync(target: RedisTarget, password: str | None, timeout_s: float = 2.0) -> str | None:
    """None when Redis answers PING within timeout_s, else why not (one line). For start-up and
    `molctl check` (a plain blocking client: nothing else runs then)."""
    import redis

    client = _sync_client(target, password, timeout_s)
    try:
        client.ping()
        return None
    except redis.RedisError as exc:
        return _why(exc, password)
    finally:
        client.close()


def _why(exc: BaseException, password: str | None) -> str:
    """Why a store call from outside the proxy failed (one line). A server that wants a password
    while none is configured says so (redis-py's own words there are about HELLO)."""
    import redis

    if isinstance(exc, redis.AuthenticationError) or "NOAUTH" in str(exc):
        if password is None:
            return (
                f"the server requires a password and none is configured (proxy.store_password_file or {PASSWORD_ENV})"
            )
        return f"authentication failed ({exc}); the password comes from proxy.store_password_file or {PASSWORD_ENV}"
    return str(exc) or type(exc).__name__


def unreachable_error(target: RedisTarget, why: str) -> RedisConfigError:
    return RedisConfigError(f"proxy.store {target.address}: unreachable: {why}")


class RedisState:
    """The connection, its health, the key layout and the replica registry (see the module docstring).
    `clock`: wall time (records carry it; the caps and the heartbeats compare it across replicas)."""

    def __init__(
        self,
        target: RedisTarget,
        password: str | None,
        profile: str,
        *,
        replica_id: str,
        advertise_upstream: str,
        ttl_s: float = DEFAULT_TTL_S,
        max_entries: int = 100_000,
        call_timeout_s: float = CALL_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
        heartbeat_s: float = HEARTBEAT_S,
        heartbeat_ttl_s: float = HEARTBEAT_TTL_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
        tenant_max_entries: int | None = None,
        tenant_max_bytes: int | None = None,
    ):
        self.target, self._password = target, password
        self.prefix = f"molctl:{{{profile}}}:"
        self.replica_id, self.advertise_upstream = check_replica_id(replica_id), advertise_upstream
        self.ttl_s, self.max_entries, self.call_timeout_s, self.clock = (
            int(max(1, ttl_s)),
            max_entries,
            call_timeout_s,
            clock,
        )
        self.heartbeat_s, self.heartbeat_ttl_s = heartbeat_s, heartbeat_ttl_s
        # the Responses records' bounds (see RESPONSES): global caps, and one tenant's (API key's) quota,
        # by default a quarter of each (as the SQLite store's: `tenant_bounds`), never above them
        self.max_bytes = max_bytes
        self.tenant_max_entries = min(
            max_entries, tenant_max_entries if tenant_max_entries is not None else max(1, max_entries // TENANT_SHARE)
        )
        self.tenant_max_bytes = min(
            max_bytes, tenant_max_bytes if tenant_max_bytes is not None else max(1, max_bytes // TENANT_SHARE)
        )
        self._pool = None  # redis-py's BlockingConnectionPool, made on first use (_connection_pool)
        self._scripts_loaded = False  # SCRIPT LOAD done on the current connection pool's server
        self._batch: list[tuple[str, list[str], list[Any], asyncio.Future]] = []
        self.degraded = False
        self.closed = False  # close() was called (see call())
        self.degraded_total = 0  # times the store went from healthy to degraded
        self.errors_total = 0  # failed or skipped calls
        self._retry_at = 0.0
        self._batches: set[asyncio.Task] = set()
        self._peers: dict[str, tuple[float, str | None]] = {}  # replica -> (checked at, upstream or None)
        self._heartbeat: asyncio.Task | None = None
        self._beat_pending: asyncio.Future | None = None  # the heartbeat's write in flight (see _beat_write)
        self._refused_logged: dict[str, float] = {}  # error kind -> when last logged (refused())
        # the last connection released while no call waited for the pool: the next call takes it
        # without the pool's locks and checks (see _exchange); (its pool, the connection)
        self._idle: tuple[Any, Any] | None = None
        self._pool_waiters = 0  # calls inside pool.get_connection()

    # ---------------------------------------------------------------- connection
    def _connection_pool(self):
        if self._pool is None:
            import redis
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            # one retry, on a dropped connection only (a pooled connection that died with a restarted
            # Redis reconnects instead of failing the call); no retry on a timeout: the call's own
            # timeout bounds it all, the degraded state paces the retries; at most MAX_CONNECTIONS,
            # a call waits for a free one within its own timeout (backpressure)
            kw = _client_kwargs(self.target, self._password)
            pool_kw = {k: v for k, v in kw.items() if k != "ssl"}
            pool_kw["retry"] = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
            # no socket read/write timeout: every use of a connection runs under the call's own timeout
            # (call()), which bounds the reads and writes already (a cancelled read disconnects); with
            # one, redis-py would run each send as a task of its own (asyncio.wait_for)
            pool_kw["socket_timeout"] = None
            if kw.get("ssl"):
                pool_kw["connection_class"] = aioredis.SSLConnection
            self._pool = aioredis.BlockingConnectionPool(
                max_connections=MAX_CONNECTIONS, timeout=self.call_timeout_s, **pool_kw
            )
            self._scripts_loaded = False
        return self._pool

    async def call(self, what: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        """fn() (its commands through `command`, `transaction` or `_exchange`) awaited under
        call_timeout_s; StoreUnavailable on any failure (see the module docstring)."""
        import redis

        if self.closed:
            self.errors_total += 1
            raise StoreUnavailable("closed")
        now = time.monotonic()
        if self.degraded and now < self._retry_at:
            self.errors_total += 1
            raise StoreUnavailable("degraded")
        if self.degraded:
            self._retry_at = now + RETRY_S  # this call is the one retry; the others keep failing fast
        try:
            async with asyncio.timeout(self.call_timeout_s):
                result = await fn()
        except redis.ResponseError as exc:
            # the server answered and refused this command (OOM, ACL, READONLY): it is reachable, only this call fails
            self.refused(what, exc)
            raise StoreUnavailable(str(exc)) from None
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self._failed(what, exc)
            raise StoreUnavailable(str(exc)) from None
        if self.degraded:
            self.degraded = False
            log.warning("state store %s: reachable again; shared state restored", self.target.address)
        return result

    def refused(self, what: str, exc: BaseException) -> None:
        """Redis answered with an error (out of memory, no permission, a read-only replica): counted;
        logged once per kind of error and REFUSED_LOG_S. The store is not degraded: other calls
        (reads) still work. READONLY (the server is a replica: a failover, or proxy.store names a
        replica) also drops the connections, so the next call connects again: a promoted server, or
        a DNS name that moved to the new primary, is written at once. (Marking the store degraded
        instead made it flap: each write degraded it, the next read "recovered" it.)"""
        self.errors_total += 1
        why = str(exc) or type(exc).__name__
        # a script's errors read "Error running script ...: -READONLY ..." / "... OOM ... maxmemory"
        kind = "maxmemory" if "maxmemory" in why else "readonly" if "READONLY" in why else type(exc).__name__
        if kind == "readonly":
            self._drop_pool()
        now = time.monotonic()
        if now - self._refused_logged.get(kind, -REFUSED_LOG_S) >= REFUSED_LOG_S:
            self._refused_logged[kind] = now
            hint = ""
            if kind == "maxmemory":
                hint = (
                    "; Redis is at maxmemory and evicts nothing: set maxmemory-policy volatile-lru (every molctl key "
                    "has a TTL) or raise maxmemory"
                )
            elif kind == "readonly":
                hint = (
                    "; the server is a read-only replica (a failover?): proxy.store must name the primary; "
                    "reconnecting on every refusal, Responses requests that store state get 503 meanwhile"
                )
            log.warning(
                "state store %s: %s refused by the server (%s)%s; counted in store_errors_total",
                self.target.address,
                what,
                why,
                hint,
            )

    def unreadable(self, what: str, key: str) -> None:
        """A stored value that is not what molctl writes there: ignored (as absent), counted, and
        logged at most once per REFUSED_LOG_S."""
        self.errors_total += 1
        now = time.monotonic()
        if now - self._refused_logged.get("unreadable", -REFUSED_LOG_S) >= REFUSED_LOG_S:
            self._refused_logged["unreadable"] = now
            log.warning(
                "state store %s: an unreadable %s at %s was ignored (treated as absent; written by another "
                "molctl version or by hand?); counted in store_errors_total",
                self.target.address,
                what,
                key,
            )

    def _failed(self, what: str, exc: BaseException) -> None:
        self.errors_total += 1
        self._retry_at = time.monotonic() + RETRY_S
        if not self.degraded:
            self.degraded = True
            self.degraded_total += 1
            why = str(exc) or type(exc).__name__
            log.warning(
                "state store %s: %s failed (%s); degraded: chat continues without shared state, "
                "Responses requests that need it get 503 until it is back",
                self.target.address,
                what,
                why,
            )
        self._drop_pool()  # a timed-out connection may hold a half-read reply: the next call starts clean

    def _drop_pool(self) -> None:
        """Close the connections (in the background); the next call connects again."""
        pool, self._pool, self._idle = self._pool, None, None  # closing the pool disconnects the idle one too
        if pool is not None:
            asyncio.get_running_loop().create_task(_close_quietly(pool))

    async def available(self) -> None:
        """Raise StoreUnavailable unless a PING answers (fast when degraded: see call())."""
        await self.call("ping", lambda: self.command("PING"))

    async def _beat_write(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """A heartbeat write that a cancelled heartbeat does not interrupt (shielded): close()
        waits for it, so that its SET cannot reach Redis after the unregistering DEL (two
        connections: their commands are not ordered) and register a stopped replica again."""
        self._beat_pending = asyncio.ensure_future(self.call("heartbeat", fn))
        return await asyncio.shield(self._beat_pending)

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
            self._heartbeat = None
            pending, self._beat_pending = self._beat_pending, None
            if pending is not None:
                await asyncio.wait([pending], timeout=self.call_timeout_s * 2)
                if pending.done() and not pending.cancelled():
                    pending.exception()  # retrieved: a failed beat is counted by call() already
            try:
                await self.call("unregister", lambda: self.command("DEL", self._replica_key(self.replica_id)))
            except StoreUnavailable:
                pass
        if self._batches:  # writes started before close go out first (after it they reopened a client nobody closed)
            await asyncio.wait(list(self._batches), timeout=self.call_timeout_s * 2)
        self.closed = True  # from now on every call fails at once (StoreUnavailable): none reopens a client
        pool, self._pool, self._idle = self._pool, None, None
        if pool is not None:
            await _close_quietly(pool)

    def stats(self) -> dict[str, int]:
        return {
            "store_degraded": int(self.degraded),
            "store_degraded_total": self.degraded_total,
            "store_errors_total": self.errors_total,
        }

    # ---------------------------------------------------------------- records
    def put(self, key: str, group: str, value: bytes) -> asyncio.Future:
        """Store a record (TTL, the group's cap), started now: its future, to await (see _write)."""
        args = [value, self.ttl_s, self.clock(), self.max_entries, f"{group}_evicted"]
        return self._write("put", [key, self.prefix + "idx:" + group, self.prefix + "stats"], args)

    def put_response(
        self, key: str, tenant: str, value: bytes, previous: str = "", messages: list[bytes] | tuple[()] = ()
    ) -> asyncio.Future:
        """Store a Responses record under its tenant's quota and the global caps (RESPONSES), with
        its conversation `messages` (each one's JSON) in a chain (PUT_RESPONSE: only the new ones
        when `previous`, the key of the response it continues, is its chain's newest), started
        now: its future (how many responses it evicted; see _write)."""
        args = [
            self.prefix,
            value,
            self.ttl_s,
            self.clock(),
            tenant,
            self.max_entries,
            self.max_bytes,
            self.tenant_max_entries,
            self.tenant_max_bytes,
            previous,
            *messages,
        ]
        return self._write("rput", [key], args)

    def merge_turn(self, key: str, value: bytes) -> asyncio.Future:
        """Merge a turn's state (a later state is never overwritten), started now: its future, to
        await (the merged turn's JSON; see _write)."""
        args = [value, self.ttl_s, self.clock(), self.max_entries, "conv_evicted"]
        return self._write("turn", [key, self.prefix + "idx:conv", self.prefix + "stats"], args)

    def _write(self, script: str, keys: list[str], args: list[Any]) -> asyncio.Future:
        """Writes are batched: those started in one turn of the event loop (concurrent requests,
        summaries) go out in one pipeline, one round trip (each socket write costs CPU that
        concurrent requests would otherwise queue behind). The write's future: its script's reply,
        or StoreUnavailable. RuntimeError without a running loop in this thread."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._batch:  # the batch's task starts at the next turn of the loop, after this turn's writes
            self._track_batch(loop.create_task(self._send_batch()))
        self._batch.append((script, keys, args, future))
        return future

    async def _exchange(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send `commands` in one round trip on one connection of the pool and read their replies in
        order; an error the server answers (a ResponseError: NOSCRIPT, OOM, READONLY) is returned in
        its command's place, as a pipeline with raise_on_error=False does (what a redis-py pipeline
        does, without its command stack and callbacks: the replies are raw). Any other failure on
        the way (a timeout, a cancellation, a reply cut mid-way) disconnects the connection before it
        goes back to the pool: a half-read reply is never read by the next call. A connection that
        turns out dropped (ConnectionError: e.g. Redis restarted since it was last used) is
        connected again and the commands sent once more; a timeout is never retried. The connection
        comes from the pool (MAX_CONNECTIONS, a call waits for one within pool.timeout), or is the
        one the previous call kept aside (`_idle`: only while no call waits for the pool)."""
        import redis

        pool = self._connection_pool()
        idle, self._idle = self._idle, None
        if idle is not None and idle[0] is pool:
            conn = idle[1]
        else:
            self._pool_waiters += 1
            try:
                conn = await pool.get_connection()  # at most MAX_CONNECTIONS: waits within pool.timeout (backpressure)
            finally:
                self._pool_waiters -= 1
        try:
            packed = conn.pack_commands(commands)
            for attempt in (1, 2):
                try:
                    await conn.send_packed_command(packed, check_health=False)
                    replies: list[Any] = []
                    for _ in commands:
                        try:
                            replies.append(await conn.read_response())
                        except redis.ResponseError as exc:  # the whole reply was read: the connection is clean
                            replies.append(exc)
                    return replies
                except redis.ConnectionError:
                    await conn.disconnect(nowait=True)
                    if attempt == 2:
                        raise
            raise AssertionError("unreachable")
        except BaseException:
            await conn.disconnect(nowait=True)
            raise
        finally:
            current = self._pool is pool
            # kept for the next call only while nobody waits for the pool (it counts as in use there)
            if current and self._idle is None and not self._pool_waiters and conn.is_connected:
                self._idle = (pool, conn)
            else:
                if not current:  # a pool dropped meanwhile (_failed, close) closed its connections already
                    await conn.disconnect(nowait=True)  # this one reconnected since (the retry): closed too
                await pool.release(conn)

    async def command(self, *args: Any) -> Any:
        """One command, one round trip (see _exchange); its raw reply (bytes, a list, None...)."""
        reply = (await self._exchange([args]))[0]
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def transaction(self, *commands: tuple[Any, ...]) -> list[Any]:
        """`commands` in MULTI/EXEC, one round trip; their replies (EXEC's). A refused command
        (an error at queueing) raises it, as EXEC then aborts the whole transaction."""
        replies = await self._exchange([("MULTI",), *commands, ("EXEC",)])
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return replies[-1]

    async def _load_scripts(self) -> None:
        shas = await self._exchange([("SCRIPT", "LOAD", source) for source in SCRIPTS.values()])
        for sha in shas:
            if isinstance(sha, BaseException):
                raise sha
        SCRIPT_SHA.update(zip(SCRIPTS, (sha.decode() for sha in shas), strict=True))
        self._scripts_loaded = True

    async def script(self, what: str, name: str, keys: list[str], args: list[Any]) -> Any:
        """One script call (a read: not batched), one round trip; a Redis that lost its scripts
        (restarted, SCRIPT FLUSH) gets them again within the same call."""
        import redis

        async def run():
            if not self._scripts_loaded:
                await self._load_scripts()
            try:
                return await self.command("EVALSHA", SCRIPT_SHA[name], len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                await self._load_scripts()
                return await self.command("EVALSHA", SCRIPT_SHA[name], len(keys), *keys, *args)

        return await self.call(what, run)

    def _track_batch(self, task: asyncio.Task) -> None:
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    async def _send_batch(self) -> None:
        import redis

        batch, self._batch = self._batch, []

        def run(entries):
            return self._exchange(
                [("EVALSHA", SCRIPT_SHA[script], len(keys), *keys, *args) for script, keys, args, _ in entries]
            )

        async def send():
            if not self._scripts_loaded:
                await self._load_scripts()
            results = await run(batch)
            # NOSCRIPT: the server lost the scripts (restarted under a live connection, SCRIPT FLUSH,
            # a failover): load them again and send those writes once more, within this call
            missing = [i for i, result in enumerate(results) if isinstance(result, redis.exceptions.NoScriptError)]
            if missing:
                await self._load_scripts()
                for i, result in zip(missing, await run([batch[i] for i in missing]), strict=True):
                    results[i] = result
            return results

        try:
            results = await self.call("write", send)
        except StoreUnavailable as exc:
            results = [exc] * len(batch)
        for (_, _, _, future), result in zip(batch, results, strict=True):
            if future.done():
                continue
            if isinstance(result, redis.exceptions.NoScriptError):
                self._scripts_loaded = False  # lost again at once: loaded again by the next batch
            if isinstance(result, BaseException):
                if not isinstance(result, StoreUnavailable):
                    self.refused("write", result)
                future.set_exception(result if isinstance(result, StoreUnavailable) else StoreUnavailable(str(result)))
            else:
                future.set_result(result)

    # ---------------------------------------------------------------- replicas
    def _replica_key(self, replica: str) -> str:
        return f"{self.prefix}replica:{replica}"

    def start_heartbeat(self, healthy: Callable[[], Any]) -> None:
        """Register this replica (its advertised engine) every heartbeat_s while `await healthy()`
        is true; an unhealthy engine is unregistered, so peers take its conversations over."""
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat(healthy))

    async def _beat(self, healthy: Callable[[], Any]) -> None:
        """`instance` (random per process) tells another writer under this id apart: what the
        key held at our next beat must be our own previous beat (SET ... GET), else two proxies
        share the id (logged once; each then takes the other's conversations for its own)."""
        key = self._replica_key(self.replica_id)
        instance = os.urandom(8).hex()
        wrote, warned = False, False
        while True:
            try:
                ok = bool(await healthy())
                beat = json.dumps({"upstream": self.advertise_upstream, "at": self.clock(), "instance": instance})
                if ok:
                    old = await self._beat_write(
                        lambda beat=beat: self.command("SET", key, beat, "PX", int(self.heartbeat_ttl_s * 1000), "GET")
                    )
                    prior = _decode(old) if old else None
                    if wrote and old and not warned and (prior is None or prior.get("instance") != instance):
                        warned = True
                        log.warning(
                            "replica id %s is also used by another proxy (engine %s): give each replica its own "
                            "--replica-id; until then each takes the other's conversations for its own (no affinity)",
                            self.replica_id,
                            (prior or {}).get("upstream"),
                        )
                    wrote = True
                else:
                    await self._beat_write(lambda: self.command("DEL", key))
                    wrote = False
            except StoreUnavailable:
                pass
            except Exception:  # a bug here must not end the heartbeat for good
                log.exception("replica heartbeat failed")
            await asyncio.sleep(self.heartbeat_s)

    async def engine_for(self, owner: str | None) -> EngineChoice | None:
        """The engine of the replica that served the conversation last, when that is another
        replica with a fresh heartbeat; None: this replica's own engine (it takes over)."""
        if owner is None or owner == self.replica_id:
            return None
        now = time.monotonic()
        checked = self._peers.get(owner)
        if checked is None or now - checked[0] > min(1.0, self.heartbeat_s):
            try:
                raw = await self.call("heartbeat read", lambda: self.command("GET", self._replica_key(owner)))
            except StoreUnavailable:
                return None
            # fresh while the key lives: its TTL runs on the Redis server's clock (the replicas'
            # wall clocks may disagree; `at` is informational)
            beat = _decode(raw, upstream=str) if raw else None
            if raw and beat is None:
                self.unreadable("heartbeat", self._replica_key(owner))
            upstream = beat["upstream"] if beat else None
            checked = (now, upstream)
            self._peers[owner] = checked
        return EngineChoice(owner, checked[1]) if checked[1] else None


async def _close_quietly(pool) -> None:
    """Close the pool's connections."""
    try:
        await pool.aclose()
    except Exception:  # noqa: BLE001 - the connection is being dropped anyway
        pass


# ---------------------------------------------------------------------- the Responses API


class RedisResponseStore:
    """The Responses API's records in Redis (async methods; the app awaits them). Each failure is
    a StoreUnavailable (503 + Retry-After)."""

    def __init__(self, state: RedisState):
        self.state = state

    def _key(self, tenant: str, response_id: str) -> str:
        return f"{self.state.prefix}r:{tenant}:{response_id}"

    async def available(self) -> None:
        """Fails fast (503) while the store is degraded (a PING once the retry interval passed);
        free otherwise: a store lost since then fails the request's own call."""
        if self.state.degraded:
            await self.state.available()

    async def put_response(self, record: ResponseRecord, big: bool = False) -> None:
        """Stored with the store keys the next request of its chain reads (its conversation's
        turns, its tool calls: kept by RedisConversationStore during this request), so that
        `get_previous` returns them with it. (`big`, the proxy's hint of a large request, is not
        used: the record is encoded on the loop, as every record of this store.)"""
        messages = [
            json.dumps(m, ensure_ascii=False, separators=(",", ":")).encode() for m in record.get("messages") or ()
        ]
        raw = json.dumps({**record, "messages": []}, ensure_ascii=False, separators=(",", ":")).encode()
        reads = _REQUEST_READS.get()
        if reads is not None and reads.names:
            raw = " ".join(dict.fromkeys(reads.names)).encode() + b"\n" + raw
        st = self.state
        whole = len(raw) + sum(map(len, messages))  # what it holds with its conversation (its chain's share included)
        for cap, name in (
            (st.max_bytes, "proxy.store_max_bytes"),
            (st.tenant_max_bytes, "proxy.store_tenant_max_bytes"),
        ):
            if whole > cap:  # evicting every other record could not make room: refused before the write
                raise QuotaExceeded(
                    f"response store {st.target.address}: a record of {whole} bytes (with its "
                    f"conversation) is over {name} ({cap}): not stored",
                    whole,
                    cap,
                    name,
                )
        previous = record.get("previous_response_id")
        await st.put_response(
            self._key(record["tenant"], record["id"]),
            record["tenant"],
            raw,
            self._key(record["tenant"], previous) if isinstance(previous, str) else "",
            messages,
        )

    def _fresh(self, raw: bytes, key: str, chain: list | None = None) -> ResponseRecord | None:
        """The record, unless expired by its own clock or unreadable (then as absent: a 404), with its
        conversation from its chain (`chain`: GET_CHAIN's {COUNT, message...}; None: the record holds its own)."""
        record = _decode(_record_json(raw), created_at=(int, float))
        if record is not None and chain is not None:
            try:
                if len(chain) - 1 != int(chain[0]):
                    raise ValueError("chain shorter than the record")
                record["messages"] = fastjson.loads(b"[" + b",".join(chain[1:]) + b"]")
            except (ValueError, TypeError):
                self.state.unreadable("response conversation (its chain's list is missing or short)", key)
                return None
        if record is None:
            self.state.unreadable("response", key)
            return None
        return record if self.state.clock() - float(record["created_at"]) <= self.state.ttl_s else None

    async def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None:
        """The record and its chain's messages in one round trip (GET_CHAIN)."""
        key = self._key(tenant, response_id)
        reply = await self.state.script("read", "chain", [key], [self.state.prefix])
        return None if reply[0] is None else self._fresh(reply[0], key, reply[1])

    async def get_previous(self, tenant: str, response_id: str) -> ResponseRecord | None:
        """The response a request continues, and in the same round trip (one script) the current
        state of its conversation's turns and tool calls, which this request's `load` then uses
        instead of reading them again. The keys come from the record, written by this tenant's
        own request (the record's key holds the tenant); `load` uses only the keys it computed itself."""
        reply = await self.state.script("read", "chain", [self._key(tenant, response_id)], [self.state.prefix])
        raw = reply[0]
        if raw is None:
            return None
        record = self._fresh(raw, self._key(tenant, response_id), reply[1])
        if record is None:
            return None
        names = raw[: raw.index(b"\n")].split() if raw[:1] != b"{" else []  # ASCII whitespace, as the script splits
        if len(names) == len(reply) - 2:
            _REQUEST_READS.set(_RequestReads({n.decode(): v for n, v in zip(names, reply[2:], strict=True)}))
        return record

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        """Deleted with its accounting (one script: RESPONSES)."""
        deleted = await self.state.script("delete", "rdel", [self._key(tenant, response_id)], [self.state.prefix])
        return bool(deleted)

    def stats(self) -> dict[str, int]:
        return dict(self.state.stats())

    def close(self) -> None:
        pass  # the RedisState is closed by the app's shutdown


# ---------------------------------------------------------------------- stateless chat

_STATES = ("pending", "summary", "failed", "stale")


def _turn_state(record: TurnRecord) -> str:
    if record.stale:
        return "stale"
    if record.summary is not None:
        return "summary"
    return "failed" if record.summary_failed or record.finished else "pending"


def _apply(record: TurnRecord, data: dict[str, Any]) -> None:
    """Bring a local record to the merged state (without writing it back)."""
    state = data.get("state")
    if state == "stale":
        record.stale, record.summary = True, None
    elif state == "summary":
        record.summary, record.summary_failed = data.get("summary"), False
    elif state == "failed":
        record.summary, record.summary_failed = None, True
    if state != "pending":
        record.settle()
    record.replica = data.get("replica") or record.replica


class _Persist:
    """A TurnRecord's on_change under RedisConversationStore: its new state is merged in Redis."""

    __slots__ = ("key", "store")

    def __init__(self, store: RedisConversationStore, key: bytes):
        self.store, self.key = store, key

    def __call__(self, record: TurnRecord) -> None:
        self.store._write_turn(self.key, record)


class RedisConversationStore:
    """Stateless chat's state shared by the replicas. The orchestrator's lookups stay synchronous
    (they run in `prepare`, possibly in a worker thread) and read a local MemoryStore; Redis is
    read once per request by `load` (one MGET of the history's turn keys and the pending tool
    calls, into the cache: Redis is the source of truth, a cached record is brought to the
    stored state) and written behind: each put starts a write task, `flush` awaits the writes of
    this request before its answer's last bytes go out (the client's next turn may go to another
    replica at once). A turn still pending on another replica is polled until its summary lands
    or `summary_wait_s` passes. Failures are counted by the RedisState (degraded) and never fail
    a chat request."""

    def __init__(
        self, state: RedisState, cache: MemoryStore | None = None, summary_wait_s: float = 5.0, poll_s: float = 0.05
    ):
        self.state = state
        self.cache = cache if cache is not None else MemoryStore()
        self.summary_wait_s, self.poll_s = summary_wait_s, poll_s
        self._writes: set[asyncio.Future] = set()
        self._polls: set[asyncio.Task] = set()
        self.affinity_remote_total = 0  # requests whose hops went to another replica's engine
        self.affinity_takeovers_total = 0  # conversations taken over from a replica without a heartbeat

    def _tkey(self, key: bytes) -> str:
        return f"{self.state.prefix}t:{key.hex()}"

    def _ckey(self, tenant: str, call_id: str) -> str:
        return f"{self.state.prefix}c:{tenant}:{call_id}"

    @staticmethod
    def _tname(key: bytes) -> str:  # a turn's store key without the prefix
        return f"t:{key.hex()}"

    @staticmethod
    def _cname(tenant: str, call_id: str) -> str:
        return f"c:{tenant}:{call_id}"

    # ---------------------------------------------------------------- sync protocol (cache)
    def get_turn(self, key: bytes) -> TurnRecord | None:
        return self.cache.get_turn(key)

    def put_turn(self, key: bytes, record: TurnRecord) -> None:
        bound = record.on_change
        if not (isinstance(bound, _Persist) and bound.store is self and bound.key == key):
            if record.replica is None:
                record.replica = _serving(self.state.replica_id)
            record.on_change = _Persist(self, key)
            self._write_turn(key, record)
            _keep_name(self._tname(key))
        self.cache.put_turn(key, record)

    def get_call(self, tenant: str, call_id: str) -> CallBinding | None:
        return self.cache.get_call(tenant, call_id)

    def put_call(self, tenant: str, call_id: str, binding: CallBinding) -> None:
        if binding.replica is None:
            binding.replica = _serving(self.state.replica_id)
        raw = json.dumps(
            {"route": binding.route, "arguments": binding.arguments, "name": binding.name, "replica": binding.replica}
        ).encode()
        self._start_write(lambda: self.state.put(self._ckey(tenant, call_id), "conv", raw))
        _keep_name(self._cname(tenant, call_id))
        self.cache.put_call(tenant, call_id, binding)

    def stats(self) -> dict[str, int]:
        return {
            **self.cache.stats(),
            **self.state.stats(),
            "affinity_remote_total": self.affinity_remote_total,
            "affinity_takeovers_total": self.affinity_takeovers_total,
        }

    # ---------------------------------------------------------------- writes
    def _write_turn(self, key: bytes, record: TurnRecord) -> None:
        # the script decodes it and stores its own encoding (cjson): orjson's bytes store the same turn
        raw = fastjson.dumps_bytes(
            {
                "route": record.route,
                "summary": record.summary,
                "state": _turn_state(record),
                "replica": record.replica,
                "at": self.state.clock(),
            }
        )

        def written(future: asyncio.Future) -> None:
            if future.cancelled() or future.exception() is not None:  # StoreUnavailable: counted by the state
                return
            merged = fastjson.loads(future.result())
            if merged.get("state") != _turn_state(record):  # another replica's state won: take it
                _apply(record, merged)

        self._start_write(lambda: self.state.merge_turn(self._tkey(key), raw), written)

    def _start_write(
        self, start: Callable[[], asyncio.Future], then: Callable[[asyncio.Future], None] | None = None
    ) -> None:
        """Start a batched write (its future joins this request's writes: see flush); `then` runs
        when it is done, before `flush` returns. A failed write is counted by the state, never raised."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread (a worker thread): write from the loop is not possible
            self.state.errors_total += 1
            return
        future = start()
        future.add_done_callback(then or _retrieve)
        self._writes.add(future)
        future.add_done_callback(self._writes.discard)
        mine = _REQUEST_WRITES.get()
        if mine is not None:
            mine.append(future)

    def _track(self, task: asyncio.Task) -> None:
        self._polls.add(task)
        task.add_done_callback(self._polls.discard)

    async def flush(self) -> None:
        """Wait (bounded by the call timeout) for this request's writes (outside a request: all)."""
        mine = _REQUEST_WRITES.get()
        pending = [t for t in (mine if mine is not None else self._writes) if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.state.call_timeout_s * 2)

    # ---------------------------------------------------------------- per request
    async def load(self, turn_keys: list[bytes], calls: list[tuple[str, str]]) -> bool:
        """Read the history's turns and the trailing tool calls into the cache (one MGET; none
        when `get_previous` read them all in this request already); True when a turn was found
        that the cache lacked (the history must be split again)."""
        _REQUEST_WRITES.set([])
        prior = _REQUEST_READS.get()
        prefetched = (prior.prefetched if prior is not None else None) or {}
        reads = _RequestReads()  # a fresh one: the prefetched values serve this load only
        _REQUEST_READS.set(reads)
        reads.names = [self._tname(k) for k in turn_keys]
        if not turn_keys and not calls:
            return False
        names = reads.names + [self._cname(t, c) for t, c in calls]
        missing = [n for n in names if n not in prefetched]
        if missing:
            full = [self.state.prefix + n for n in missing]
            try:
                got = await self.state.call("read", lambda: self.state.command("MGET", *full))
            except StoreUnavailable:
                return False
            prefetched = {**prefetched, **dict(zip(missing, got, strict=True))}
        values = [prefetched[n] for n in names]
        added = False
        for key, raw in zip(turn_keys, values[: len(turn_keys)], strict=True):
            if raw is None:
                continue
            data = _decode(raw, route=str, state=str)
            if data is None or data["state"] not in _STATES:
                self.state.unreadable("turn", self._tkey(key))
                continue
            record = self.cache.get_turn(key)
            if record is None:
                record = TurnRecord(data["route"], replica=data.get("replica"))
                record.on_change = _Persist(self, key)
                self.cache.put_turn(key, record)
                added = True
                if (
                    data.get("state") == "pending"
                    and self.state.clock() - float(data.get("at", 0)) < self.summary_wait_s
                ):
                    self._track(asyncio.get_running_loop().create_task(self._poll(key, record)))
                elif data.get("state") == "pending":
                    data["state"] = "failed"  # its summary never came in time: fold without it
            _apply(record, data)
        for (tenant, call_id), raw in zip(calls, values[len(turn_keys) :], strict=True):
            if raw is not None and self.cache.get_call(tenant, call_id) is None:
                data = _decode(raw, route=str, name=(str, type(None)))
                if data is None or "arguments" not in data:
                    self.state.unreadable("tool-call binding", self._ckey(tenant, call_id))
                    continue
                self.cache.put_call(
                    tenant, call_id, CallBinding(data["route"], data["arguments"], data["name"], data.get("replica"))
                )
        return added

    async def _poll(self, key: bytes, record: TurnRecord) -> None:
        """Another replica's turn whose summary is still being made: read it until it lands."""
        deadline = time.monotonic() + self.summary_wait_s
        while not record.finished and time.monotonic() < deadline:
            await asyncio.sleep(self.poll_s)
            try:
                raw = await self.state.call("read", lambda: self.state.command("GET", self._tkey(key)))
            except StoreUnavailable:
                return
            if raw is not None and not record.finished:
                data = _decode(raw, route=str, state=str)
                if data is None or data["state"] not in _STATES:  # replaced by something unreadable: fold without it
                    self.state.unreadable("turn", self._tkey(key))
                    data = {"state": "failed"}
                if data.get("state") != "pending":
                    _apply(record, data)

    async def choose_engine(self, owner: str | None) -> EngineChoice | None:
        """Affinity: the owner's engine when its heartbeat is fresh, else None (this replica's)."""
        choice = await self.state.engine_for(owner)
        if choice is not None:
            self.affinity_remote_total += 1
        elif owner is not None and owner != self.state.replica_id:
            self.affinity_takeovers_total += 1
        return choice


def _serving(default: str) -> str:
    """The replica whose engine answers the current request (affinity), else this one."""
    choice = ENGINE.get()
    return choice.replica if choice is not None and not choice.failed else default


def _retrieve(future: asyncio.Future) -> None:
    """A write nobody awaits: its StoreUnavailable is retrieved (asyncio would log it as never retrieved)."""
    if not future.cancelled():
        future.exception()


__all__ = [
    "RedisState",
    "RedisResponseStore",
    "RedisConversationStore",
    "RedisTarget",
    "StoreUnavailable",
    "RedisConfigError",
    "parse_redis_url",
    "read_password",
    "ping_sync",
    "is_redis_spec",
]


# ---------------------------------------------------------------------- from outside the proxy


def _sync_client(target: RedisTarget, password: str | None, timeout_s: float = 2.0):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw = _client_kwargs(target, password)
    kw.update(socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    return redis.Redis(**kw)


def describe_sync(target: RedisTarget, password: str | None, profile: str) -> dict[str, Any]:
    """What `molctl state stats` shows for a Redis store: this profile's indexed records per group
    (expired ones not yet trimmed from the index included), evicted totals, registered replicas,
    and the server's memory settings. RedisConfigError (one line) when unreachable."""
    import redis

    prefix = f"molctl:{{{profile}}}:"
    client = _sync_client(target, password)
    try:
        info = client.info("server")
        memory = client.info("memory")
        replication = client.info("replication")
        evicted = {k.decode(): int(v) for k, v in (client.hgetall(prefix + "stats") or {}).items()}
        replicas = sorted(
            k.decode()[len(prefix) + len("replica:") :] for k in client.scan_iter(prefix + "replica:*", count=100)
        )
        return {
            "address": target.address,
            "redis_version": info.get("redis_version"),
            "maxmemory": int(memory.get("maxmemory", 0)),
            "maxmemory_policy": memory.get("maxmemory_policy"),
            "used_memory": int(memory.get("used_memory", 0)),
            "responses": client.zcard(prefix + "idx:r"),
            "conversation_rows": client.zcard(prefix + "idx:conv"),
            "responses_bytes": evicted.get("r_bytes", 0),
            "tenants": client.zcard(prefix + "tn"),
            "key_format": evicted.get("format", 1 if client.exists(prefix + "idx:r") else KEY_FORMAT),
            "responses_evicted": evicted.get("r_evicted", 0),
            "conversation_evicted": evicted.get("conv_evicted", 0),
            "replicas": replicas,
            # "slave": a read-only replica (what a primary becomes after a failover); every write refused
            "role": replication.get("role"),
            "primary": (
                f"{replication.get('master_host')}:{replication.get('master_port')}"
                if replication.get("role") == "slave"
                else None
            ),
        }
    except redis.RedisError as exc:
        raise unreachable_error(target, _why(exc, password)) from None
    finally:
        client.close()


def prune_sync(
    target: RedisTarget,
    password: str | None,
    profile: str,
    ttl_s: float,
    max_entries: int,
    clock: Callable[[], float] = time.time,
    max_bytes: int = DEFAULT_MAX_BYTES,
    tenant_max_entries: int | None = None,
    tenant_max_bytes: int | None = None,
) -> dict[str, int]:
    """Redis expires the records itself (TTL) and each write evicts over the caps; this trims the
    index entries of expired records and evicts what is over the caps now (e.g. after a cap was
    lowered): responses under the same tenant quotas and global caps as a write (RESPONSES, in
    script calls of at most PRUNE_BATCH each), chat state over `max_entries`. Returns what it removed."""
    import redis

    prefix = f"molctl:{{{profile}}}:"
    client = _sync_client(target, password)
    out: dict[str, int] = {"expired": 0, "evicted": 0}
    t_entries = min(
        max_entries, tenant_max_entries if tenant_max_entries is not None else max(1, max_entries // TENANT_SHARE)
    )
    t_bytes = min(max_bytes, tenant_max_bytes if tenant_max_bytes is not None else max(1, max_bytes // TENANT_SHARE))
    try:
        prune = client.register_script(RESPONSES + PRUNE_RESPONSES)
        more = 1
        while more:
            expired, evicted, more = prune(
                keys=[prefix + "idx:r"],
                args=[prefix, clock(), int(max(1, ttl_s)), max_entries, max_bytes, t_entries, t_bytes, PRUNE_BATCH],
            )
            out["expired"] += expired
            out["evicted"] += evicted
        for group, name in (("conv", "conversation_"),):
            idx = prefix + "idx:" + group
            out[name + "expired"] = client.zremrangebyscore(idx, "-inf", clock() - ttl_s)
            over = client.zcard(idx) - max_entries
            victims = client.zrange(idx, 0, over - 1) if over > 0 else []
            for i in range(0, len(victims), 500):
                chunk = victims[i : i + 500]
                client.delete(*chunk)
                client.zrem(idx, *chunk)
            if victims:
                client.hincrby(prefix + "stats", f"{group}_evicted", len(victims))
            out[name + "evicted"] = len(victims)
        return out
    except redis.RedisError as exc:
        raise unreachable_error(target, _why(exc, password)) from None
    finally:
        client.close()
