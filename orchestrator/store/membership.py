"""Orchestrator processes that follow the shard map register here, per shard class, with a lease they
renew; the live members divide the class's served shards among themselves (``shardmap.owners``).

One sorted set per class, member = process id, score = when its lease ends. A reading drops expired
members first, so a process that died (or stopped answering: SIGSTOP, a partition) is out once its lease
ends and its shards are taken by the others. Two processes serving one shard for a while (a paused one
waking up before it reads the membership again) is harmless: the shard queue has a single active
consumer, and every transition checks its preconditions in Redis.
"""

from __future__ import annotations

import os
import socket
import uuid

import redis.asyncio as aioredis

LEASE_MS = 10_000


def members_key(prefix: str, shard_class: str) -> str:
    return f"{prefix}:{{shardmap}}:members:{shard_class}"


def process_id() -> str:
    """Unique per process start: a restarted process is a new member, not the old one come back."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


async def redis_now_ms(client: aioredis.Redis) -> int:
    """Redis's clock: every member measures leases on the same one, whatever its host's clock says."""
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def renew(
    client: aioredis.Redis, prefix: str, classes: list[str], me: str, lease_ms: int = LEASE_MS
) -> dict[str, list[str]]:
    """Renew ``me``'s lease in each class and return each class's live members."""
    now_ms = await redis_now_ms(client)
    async with client.pipeline(transaction=False) as pipe:
        for shard_class in classes:
            key = members_key(prefix, shard_class)
            pipe.zadd(key, {me: now_ms + lease_ms})
            pipe.zremrangebyscore(key, "-inf", now_ms)
            pipe.zrange(key, 0, -1)
        replies = await pipe.execute()
    return {c: [_text(m) for m in replies[3 * i + 2]] for i, c in enumerate(classes)}


async def members(client: aioredis.Redis, prefix: str, shard_class: str) -> list[str]:
    """The live members of one class (no renewal: for who asks who serves what)."""
    found = await client.zrangebyscore(members_key(prefix, shard_class), await redis_now_ms(client), "+inf")
    return [_text(m) for m in found]


async def leave(client: aioredis.Redis, prefix: str, classes: list[str], me: str) -> None:
    """Give up the membership at once (a clean stop), so the others take its shards now."""
    async with client.pipeline(transaction=False) as pipe:
        for shard_class in classes:
            pipe.zrem(members_key(prefix, shard_class), me)
        await pipe.execute()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
