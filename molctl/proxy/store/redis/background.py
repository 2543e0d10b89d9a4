"""Background responses' jobs on Redis (molctl.proxy.store.background has the contract).

Keys (beside the store's, hash-tagged by profile: PREFIX `molctl:{PROFILE}:`):
- `PREFIX bg:TENANT:ID`: the job, a hash (`status`, `owner`, `response`: the Response's JSON);
- `PREFIX bgev:TENANT:ID`: its stream events, a list in sequence order (index = sequence_number);
- `PREFIX bgt:TENANT`: the tenant's active jobs, a sorted set scored by lease end (the limit counts it);
- `PREFIX bga`: every active job (`TENANT ID`), scored by lease end: `lapsed` reads the ended ones.
A job and its events get the store's TTL once they end (`proxy.store_ttl_s`); the create and the
status change are one script each (atomic across replicas). Every call goes through
RedisState.call: a failure is a StoreUnavailable (503 + Retry-After).
"""

from __future__ import annotations

import json
from typing import Any

from molctl.proxy.store.background import BackgroundStore, Job
from molctl.proxy.store.redis.connection import RedisState

# KEYS: job, tenant set, all set; ARGV: status, owner, Response JSON, lease end, limit, id, "tenant id", ttl
CREATE = """
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[5]) then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'owner', ARGV[2], 'response', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[8])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[6])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[7])
return 1
"""
# KEYS: job, tenant set, all set, events; ARGV: status, Response JSON, id, "tenant id", ttl, ended (0/1)
SET_STATE = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'in_progress' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'response', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[5])
if ARGV[6] == '1' then
  redis.call('ZREM', KEYS[2], ARGV[3])
  redis.call('ZREM', KEYS[3], ARGV[4])
  redis.call('EXPIRE', KEYS[4], ARGV[5])
end
return 1
"""


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class RedisBackground(BackgroundStore):
    def __init__(self, state: RedisState):
        self.state = state
        p = state.prefix
        self._all = p + "bga"
        self._job = lambda tenant, rid: f"{p}bg:{tenant}:{rid}"
        self._events = lambda tenant, rid: f"{p}bgev:{tenant}:{rid}"
        self._tenant = lambda tenant: f"{p}bgt:{tenant}"

    async def create(self, job: Job, lease_until: float, limit: int) -> bool:
        t, rid = job["tenant"], job["id"]
        keys = [self._job(t, rid), self._tenant(t), self._all]
        args = [job["status"], job["owner"], _dumps(job["response"]), lease_until, limit, rid, f"{t} {rid}"]
        args.append(self.state.ttl_s)
        reply = await self.state.call("background", lambda: self.state.command("EVAL", CREATE, 3, *keys, *args))
        return reply == 1

    async def get(self, tenant: str, response_id: str) -> Job | None:
        key = self._job(tenant, response_id)
        raw = await self.state.call(
            "background", lambda: self.state.command("HMGET", key, "status", "owner", "response")
        )
        if not raw or raw[0] is None or raw[2] is None:
            return None
        status, owner = (v.decode() if isinstance(v, bytes) else v for v in raw[:2])
        return {"id": response_id, "tenant": tenant, "status": status, "owner": owner, "response": json.loads(raw[2])}

    async def set_state(self, tenant: str, response_id: str, status: str, response: dict[str, Any]) -> bool:
        ended = "0" if status in ("queued", "in_progress") else "1"
        keys = [self._job(tenant, response_id), self._tenant(tenant), self._all, self._events(tenant, response_id)]
        args = [status, _dumps(response), response_id, f"{tenant} {response_id}", self.state.ttl_s, ended]
        reply = await self.state.call("background", lambda: self.state.command("EVAL", SET_STATE, 4, *keys, *args))
        return reply == 1

    async def append(self, tenant: str, response_id: str, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        key = self._events(tenant, response_id)
        await self.state.call(
            "background",
            lambda: self.state.transaction(("RPUSH", key, *map(_dumps, events)), ("EXPIRE", key, self.state.ttl_s)),
        )

    async def events(self, tenant: str, response_id: str, after: int) -> list[dict[str, Any]]:
        key = self._events(tenant, response_id)
        raw = await self.state.call("background", lambda: self.state.command("LRANGE", key, max(0, after + 1), -1))
        return [json.loads(r) for r in raw or ()]

    async def renew(self, jobs: list[tuple[str, str]], lease_until: float) -> None:
        if not jobs:
            return
        commands: list[tuple[Any, ...]] = []
        for tenant, rid in jobs:
            commands.append(("ZADD", self._all, "XX", lease_until, f"{tenant} {rid}"))
            commands.append(("ZADD", self._tenant(tenant), "XX", lease_until, rid))
        await self.state.call("background", lambda: self.state.transaction(*commands))

    async def lapsed(self, now: float) -> list[Job]:
        members = await self.state.call(
            "background", lambda: self.state.command("ZRANGEBYSCORE", self._all, "-inf", f"({now}")
        )
        out = []
        for member in members or ():
            tenant, _, rid = (member.decode() if isinstance(member, bytes) else member).rpartition(" ")
            job = await self.get(tenant, rid)
            if job is not None and job["status"] in ("queued", "in_progress"):
                out.append(job)
            elif job is None:  # expired or deleted: nothing to fail, drop it from the index
                await self.state.call(
                    "background",
                    lambda t=tenant, r=rid, m=member: self.state.transaction(
                        ("ZREM", self._all, m), ("ZREM", self._tenant(t), r)
                    ),
                )
        return out

    async def delete(self, tenant: str, response_id: str) -> bool:
        replies = await self.state.call(
            "background",
            lambda: self.state.transaction(
                ("DEL", self._job(tenant, response_id)),
                ("DEL", self._events(tenant, response_id)),
                ("ZREM", self._tenant(tenant), response_id),
                ("ZREM", self._all, f"{tenant} {response_id}"),
            ),
        )
        return bool(replies and replies[0])
