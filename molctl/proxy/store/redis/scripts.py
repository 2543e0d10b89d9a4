"""The Lua scripts of the Redis store (Redis 6.2 commands only: EVALSHA, SET EX, ZADD, ZRANGE by
index, ZREMRANGEBYSCORE, cjson), by name in SCRIPTS (loaded with SCRIPT LOAD, called by SHA).
Key layout and formats: docs/design/store.md ("Redis")."""

from __future__ import annotations

EVICT_BATCH = 64
EVICT_MAX = 1024  # a response write evicts at most this many (a large record over a byte quota of small ones)
EXPIRE_BATCH = 256  # expired index entries a response write forgets (the rest: the next writes, or a prune)
KEY_FORMAT = (
    3  # 1: one count cap per group; 2: + per-tenant quotas and byte totals; 3: + chains (`stats` field "format")
)

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
