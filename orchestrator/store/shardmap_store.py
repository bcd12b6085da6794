"""The shard map in Redis: one key under its own hash tag, written only over the version it was read at."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from orchestrator.errors import SagaError
from orchestrator.settings import Settings, redis_client
from orchestrator.shardmap import ShardMap

# Write ARGV[1] (a map of version ARGV[2] + 1) only if the stored map is still at ARGV[2] (0: none yet).
_SAVE = """
local current = redis.call('GET', KEYS[1])
local version = 0
if current then version = cjson.decode(current).version end
if version ~= tonumber(ARGV[2]) then return {0, current or ''} end
redis.call('SET', KEYS[1], ARGV[1])
return {1, ARGV[1]}
"""


class ShardMapChanged(SagaError):
    """Someone else changed the shard map between this command's read and its write."""

    code = "shard_map_changed"
    id_fields = ("version",)

    def __init__(self, version: int) -> None:
        self.version = version
        super().__init__(
            f"the shard map changed meanwhile (it is at version {version} now): nothing was changed; "
            "look at 'saga shards list' and try again"
        )


def map_key(prefix: str) -> str:
    return f"{prefix}:{{shardmap}}:map"


async def load(client: aioredis.Redis, prefix: str) -> ShardMap | None:
    raw = await client.get(map_key(prefix))
    return None if raw is None else ShardMap.from_json(_text(raw))


async def load_or_seed(client: aioredis.Redis, prefix: str, classes: tuple[str, ...], count: int) -> ShardMap:
    """The stored map; the first time, the one ``SAGA_SHARD_CLASSES`` and ``SAGA_SHARD_COUNT`` describe,
    stored (whoever seeds first wins; the settings are read only this once)."""
    await client.set(map_key(prefix), ShardMap.seed(classes, count).to_json(), nx=True)
    stored = await load(client, prefix)
    if stored is None:  # deleted between the two calls: seed again
        return await load_or_seed(client, prefix, classes, count)
    return stored


async def save(client: aioredis.Redis, prefix: str, changed: ShardMap) -> None:
    """Store ``changed`` if the stored map is still the one it was made from (its version less one)."""
    written, current = await client.eval(  # type: ignore[misc]
        _SAVE, 1, map_key(prefix), changed.to_json(), changed.version - 1
    )
    if not int(written):
        text = _text(current)
        raise ShardMapChanged(ShardMap.from_json(text).version if text else 0)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def current_map(settings: Settings, *, seed: bool) -> ShardMap:
    """The namespace's shard map from Redis; with ``seed``, stored first if there is none yet. Without,
    a namespace that has none gets the first map the settings describe (nothing stored)."""
    client = redis_client(settings)
    try:
        if seed:
            classes, count = settings.shard_classes, settings.shard_count
            return await load_or_seed(client, settings.key_prefix, classes, count)
        stored = await load(client, settings.key_prefix)
        return stored or ShardMap.seed(settings.shard_classes, settings.shard_count)
    finally:
        await client.aclose()
